"""A mixed step: one forward that reads a prompt chunk and decodes the running rows together (vLLM's
chunked prefill, done here over two caches).

A prompt is read on a one-row cache of its own (the server's prefill job) while the running rows decode
on the batch cache. Run apart, every chunk and every decode step streams the model's weights once each;
run as one forward, the linear layers multiply the chunk's T tokens and the R decode tokens as one
[1, T + R] sequence and stream the weights once. Only the attention tells the two apart:
``TwoCaches`` stands in for the model's cache and sends each layer's keys and queries to the cache
they belong to, the chunk's to the prompt cache as a [1, T] chunk and the decode tokens to the batch
cache as R rows of one token (rows left out as in any decode step). Each cache numbers its own tokens
(``H2OCache.position_ids``) before the forward, so the step writes what the two forwards would have
written, and the logits equal theirs up to the order of the linear layers' sums.
"""

from __future__ import annotations

import torch

from ..kv import AttentionMismatchError, H2OCache
from ..model_shape import cache_argument
from .forward_step import require_h2o_attention


class TwoCaches:
    """The cache a mixed forward hands the model: the first ``chunk`` tokens of the one sequence go to
    ``prompt`` (one row), the other R to ``batch`` (one per row). Only what transformers' models and
    the h2o attention call is here: ``update`` (parks each part's keys on its cache) and ``attend``;
    transformers' size queries go to the prompt cache (``__getattr__``)."""

    def __init__(self, prompt: H2OCache, batch: H2OCache, chunk: int):
        self.prompt, self.batch, self.chunk = prompt, batch, chunk
        # the layer in flight: the keys update was given, and each cache's parked (keys, values)
        self._parts: tuple | None = None

    @staticmethod
    def as_rows(part: torch.Tensor) -> torch.Tensor:
        """[1, H, R, D] (R decode tokens of one sequence) -> [R, H, 1, D] (one token per row)."""
        return part[0].transpose(0, 1).unsqueeze(2).contiguous()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        t = self.chunk
        prompt_kv = self.prompt.update(key_states[:, :, :t], value_states[:, :, :t], layer_idx)
        decode_kv = self.batch.update(self.as_rows(key_states[:, :, t:]), self.as_rows(value_states[:, :, t:]), layer_idx)
        self._parts = (key_states, prompt_kv, decode_kv)
        return key_states, value_states

    def attend(self, layer_idx: int, query, key, value, new_valid, scale) -> torch.Tensor:
        """Both parts' attention, as one sequence's [1, Hkv, G, T + R, D]."""
        parked, (prompt_key, prompt_value), (decode_key, decode_value) = self._parts
        self._parts = None
        if key is not parked:  # (what ``H2OLayer.take_pending`` checks for a cache of its own)
            raise AttentionMismatchError(f"layer {layer_idx}: the keys given to the attention are not the ones "
                                         "the mixed step's update received")
        t = self.chunk
        prompt_out = self.prompt.attend(layer_idx, query[:, :, :t], prompt_key, prompt_value, None, scale)
        decode_out = self.batch.attend(layer_idx, self.as_rows(query[:, :, t:]), decode_key, decode_value, None, scale)
        # [R, Hkv, G, 1, D] -> [1, Hkv, G, R, D]
        decode_out = decode_out.squeeze(3).permute(1, 2, 0, 3).unsqueeze(0)
        return torch.cat([prompt_out, decode_out], dim=3)

    def __getattr__(self, name):
        # what else transformers asks a cache while it builds the mask and the cache positions
        # (get_seq_length, get_mask_sizes, get_query_offset, ...): the prompt cache answers, as it
        # would for the chunk alone (the h2o mask function and the caches' own positions ignore it)
        return getattr(self.prompt, name)


def mixed_forward(model, prompt: H2OCache, chunk_ids: torch.Tensor, batch: H2OCache, tokens: torch.Tensor,
                  active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``chunk_ids`` [1, T] into ``prompt`` and decode ``tokens`` [R] through ``batch`` (``active``
    [R] bool: the rows taking part, None: all) in one forward: (the chunk's last-token logits [V], the
    rows' next-token logits [R, V])."""
    require_h2o_attention(model)
    chunk, rows = chunk_ids.shape[1], tokens.shape[0]
    device = chunk_ids.device
    prompt_positions = prompt.position_ids(1, chunk, None, device=device)
    decode_positions = batch.position_ids(rows, 1, None, device=device, active=active)
    caches = TwoCaches(prompt, batch, chunk)
    kept = torch.arange(chunk - 1, chunk + rows, device=device)  # the chunk's last token, then each row's
    with torch.inference_mode():
        out = model(
            input_ids=torch.cat([chunk_ids, tokens.view(1, rows)], dim=1),
            position_ids=torch.cat([prompt_positions, decode_positions.view(1, rows)], dim=1),
            use_cache=True,
            logits_to_keep=kept,
            **{cache_argument(model): caches, "h2o_cache": caches},
        )
    logits = out.logits[0]
    return logits[0], logits[1:]
