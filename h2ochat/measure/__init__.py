"""Measurement: what ``eval`` and ``bench`` run. Perplexity of a text through each policy's cache
(``evaluation``), the pass-key probes alone and in a chat (``passkey``, ``passkey_probes``,
``passkey_chat``), RULER and multi-turn memory (``ruler``, ``chat_memory``) with their resumable log
and score table (``eval_log``, ``score_table``), the speed and memory benchmark (``benchmark`` over
``bench_context``, ``bench_measure``, ``bench_memory``, ``bench_ops``, ``bench_baseline``), the
figures of a long text (``textstats``), the plots (``plotting``), and h2ochat as an lm-eval model
(``lm_eval_model``, with the eval extra). It stands above the chat,
whose conversation two of its tasks measure."""
