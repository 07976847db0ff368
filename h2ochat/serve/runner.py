"""The model runner: the forwards of the server, over whichever cache the row pool (``serve.rows``)
hands it. It knows the model and its decode step (compiled or eager), nothing of rows or requests."""

from __future__ import annotations

import torch

from ..engine.generation import chunk_size, forward, prefill
from ..engine.mixed_step import mixed_forward
from ..kv import H2OCache


class ModelRunner:
    def __init__(self, model, *, prefill_chunk: int):
        self.model, self.prefill_chunk = model, prefill_chunk
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.decode_step = None

    def compile(self, backend: str | None, graphs: int) -> None:
        """Decode through the compiled step from now on; ``graphs``: the batch shapes it will be
        called with (on the CPU, more than one: a graph for one row and a dynamic one for the rest)."""
        from ..engine.compiled import CompiledDecode

        self.decode_step = CompiledDecode(self.model, backend=backend, graphs=graphs)

    def decode_eagerly(self) -> None:
        """Decode through the eager forward from now on (a compiled step that could not be built)."""
        self.decode_step = None

    def prefill_chunk_of(self, cache: H2OCache, ids: torch.Tensor, start: int) -> tuple[int, torch.Tensor | None]:
        """Feed ``ids`` [1, T] from ``start`` for one chunk: (where the next chunk starts, the
        next-token logits [V] once the last token is fed, else None)."""
        end = min(start + self.prefill_chunk, ids.shape[1])
        with torch.inference_mode():
            logits = prefill(self.model, cache, ids[:, start:end], chunk=self.prefill_chunk)
        return end, (logits[0] if end == ids.shape[1] else None)

    def mixed(self, prompt: H2OCache, ids: torch.Tensor, start: int, batch: H2OCache, tokens: list[int],
              active: list[bool]) -> tuple[int, torch.Tensor | None, torch.Tensor]:
        """``prefill_chunk_of`` and ``decode`` in one forward (``engine.mixed_step``; always eager): where
        the next chunk starts, the prompt's next-token logits [V] once its last token is fed (else None),
        and the decode rows' logits [R, V]."""
        end = start + chunk_size(prompt, ids.shape[1] - start, self.prefill_chunk)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        mask = torch.tensor(active, dtype=torch.bool, device=self.device)
        with torch.inference_mode():
            prompt_logits, logits = mixed_forward(self.model, prompt, ids[:, start:end], batch, input_ids, mask)
        return end, (prompt_logits if end == ids.shape[1] else None), logits

    def prime(self, cache: H2OCache, rows: int) -> None:
        """One eager decode step with all ``rows`` of ``cache`` left out (it writes nothing), before a
        compiled step is first built on it: what the graph reads but only an eager step allocates
        exists then (a recall tier's last queries, sized by the model's query group). A server's first
        compiled step otherwise ran on a cache no eager step had touched, and its recall tier failed
        to trace (``None.copy_``)."""
        input_ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            forward(self.model, cache, input_ids, logits_to_keep=1,
                    active=torch.zeros(rows, dtype=torch.bool, device=self.device))

    def decode(self, cache: H2OCache, tokens: list[int], active: list[bool] | None) -> torch.Tensor:
        """One decode step of every row of ``cache`` (``active``: the rows taking part; None: all):
        the next-token logits [R, V] (a row left out's are meaningless)."""
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device).view(-1, 1)
        mask = torch.tensor(active, dtype=torch.bool, device=self.device) if active is not None else None
        with torch.inference_mode():
            if self.decode_step is not None:
                return self.decode_step(cache, input_ids, mask)
            return forward(self.model, cache, input_ids, logits_to_keep=1, active=mask)[:, -1]
