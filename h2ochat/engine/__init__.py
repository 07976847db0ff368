"""The engine: running a loaded model through its cache. The ``h2o`` attention registered with
transformers (``attention``), one forward of new tokens (``forward_step``), the decode step compiled
with torch.compile (``compiled``), a bf16 model's linears packed for oneDNN on the CPU
(``packed_linears``, which ``loading`` applies), and the decode loop: chunked prefill, sampling and streaming
(``generation``), with the repetition penalty's window (``repetition``) and the streamed text of the
tokens (``detokenize``). It builds on ``kv`` and ``recall`` through the settings (``h2ochat.config``)
and knows nothing of the chat, the measurements or the server above it."""
