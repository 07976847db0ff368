"""The attention's ``rest`` column (a recall tier's unrecalled cold pages, one column per query row)
against the same attention with that column as a slot of its own: a key every query row reads with the
rest's logit, holding the rest's value. Decode steps and prompt chunks (the blocked layout), fp32 and
bf16 slots, padding rows and a decay."""

from __future__ import annotations

import pytest
import torch

from h2ochat_kernels import backend_for, reference

B, H, G, S, D = 2, 2, 3, 7, 8


def _inputs(g, q_len, dtype):
    query = torch.randn(B, H, G, q_len, D, generator=g).to(dtype)
    keys, values = torch.randn(B, H, S, D, generator=g).to(dtype), torch.randn(B, H, S, D, generator=g).to(dtype)
    index = torch.arange(S).expand(B, H, S).clone()
    index[0, :, -2:] = -1  # empty slots
    new_keys, new_values = torch.randn(B, H, q_len, D, generator=g).to(dtype), torch.randn(B, H, q_len, D, generator=g).to(dtype)
    return query, keys, values, index, new_keys, new_values


@pytest.mark.parametrize("q_len,dtype", [(1, torch.float32), (1, torch.bfloat16), (5, torch.float32), (70, torch.float32)])
@pytest.mark.parametrize("padded", [False, True])
def test_the_rest_is_one_more_slot_that_nobody_scores(seed, q_len, dtype, padded):
    g = torch.Generator().manual_seed(seed)
    query, keys, values, index, new_keys, new_values = _inputs(g, q_len, dtype)
    scale = D ** -0.5
    new_valid = None
    if padded:
        new_valid = torch.ones(B, q_len, dtype=torch.bool)
        new_valid[1, 0] = False
    # the rest as a slot: one key and value per (row, head); its logit per query row is q . k * scale
    rest_key, rest_value = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    rest_key[0, 1] = 0  # a logit of 0
    logit = (query.float() @ rest_key.unsqueeze(2).transpose(-1, -2)).squeeze(-1) * scale  # [B, H, G, Q]
    value = rest_value.unsqueeze(2).expand(B, H, G, q_len, D)
    decay = torch.tensor([1.0, 0.5])
    scores = torch.rand(B, H, S, generator=g)
    with_slot = scores.clone(), torch.cat([scores, torch.zeros(B, H, 1)], dim=2)
    want_out, want_new = reference.attend_with_scores(
        query, torch.cat([keys.float(), rest_key], 2).to(dtype), torch.cat([values.float(), rest_value], 2).to(dtype),
        torch.cat([index, torch.zeros(B, H, 1, dtype=index.dtype)], 2), new_keys, new_values, new_valid, scale,
        with_slot[1], decay)
    got_out, got_new = backend_for("cpu").attend_with_scores(query, keys, values, index, new_keys, new_values,
                                                             new_valid, scale, with_slot[0], decay,
                                                             rest=(logit, value))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_out.float(), want_out.float(), **tol)
    torch.testing.assert_close(got_new, want_new, **tol)
    torch.testing.assert_close(with_slot[0], with_slot[1][..., :S], **tol)
    # and the rest changes the result: the test can tell
    plain_out, _ = reference.attend_with_scores(query, keys, values, index, new_keys, new_values, new_valid, scale,
                                                scores.clone(), decay)
    assert not torch.allclose(plain_out.float(), got_out.float(), atol=1e-3)


def test_a_rest_of_minus_infinity_changes_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    query, keys, values, index, new_keys, new_values = _inputs(g, 4, torch.float32)
    scores = torch.rand(B, H, S, generator=g)
    again = scores.clone()
    none = (torch.full((B, H, G, 4), float("-inf")), torch.zeros(B, H, G, 4, D))
    out, new = reference.attend_with_scores(query, keys, values, index, new_keys, new_values, None, 0.3, scores,
                                            rest=none)
    want_out, want_new = reference.attend_with_scores(query, keys, values, index, new_keys, new_values, None, 0.3,
                                                      again)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(new, want_new)
    torch.testing.assert_close(scores, again)
