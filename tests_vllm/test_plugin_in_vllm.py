"""The plugin inside vLLM's CPU build, on a tiny random Llama (greedy, float32).

- With a budget that covers the whole sequence, the tokens equal vLLM's without the plugin.
- Below it, the tokens and the evicted blocks equal the block-level masked reference
  (``h2ochat_vllm.reference``), and every request holds at most its budget of blocks once its
  prompt is in (during a prompt chunk, the budget plus the chunk's blocks).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import prompts, run_vllm
from h2ochat_vllm import reference

pytestmark = pytest.mark.slow
BLOCK = 32
TIE = 1e-3  # logits this close may come out in either order on another CPU's kernels


def reference_model(folder):
    from transformers import LlamaForCausalLM

    reference.register_attention()
    return LlamaForCausalLM.from_pretrained(folder, attn_implementation=reference.ATTENTION_NAME,
                                            dtype=torch.float32).eval()


def assert_follows_reference(model, prompt, tokens, rule, chunk, summary):
    """vLLM's tokens are the reference's greedy choices (up to near ties), step by step with the
    reference fed vLLM's tokens, and the same blocks were evicted."""
    ref = reference.generate(model, prompt, len(tokens), rule, chunk, forced=tokens)
    for step, (token, logits) in enumerate(zip(tokens, ref.logits)):
        assert float(logits[token]) >= float(logits.max()) - TIE, f"step {step}: token {token} is not the reference's choice"
    assert summary["evicted"] == sorted(ref.evicted)
    return ref


def test_a_budget_over_the_whole_sequence_changes_nothing(tiny_llama, tmp_path):
    """vLLM as shipped (no plugin loaded) against the plugin with a budget that never binds."""
    spec = dict(model=str(tiny_llama), prompts=prompts(3, 200, seed=1), max_tokens=40, block_size=BLOCK,
                max_num_batched_tokens=1024)
    plain = run_vllm(tmp_path, **spec, without_plugin=True)
    with_plugin = run_vllm(tmp_path, **spec, budget=2048)
    assert with_plugin["tokens"] == plain["tokens"]
    assert all(summary["evicted"] == [] for summary in with_plugin["requests"])


@pytest.mark.parametrize("policy,rule", [("h2o:sinks=1", reference.BlockRule(BLOCK, 4, 1, 2)),
                                         ("h2o:sinks=0:heavy_ratio=0.5", reference.BlockRule(BLOCK, 4, 0, 2)),
                                         ("h2o:sinks=1", reference.BlockRule(BLOCK, 4, 1, 2, score_queries=8)),
                                         ("h2o:sinks=1", reference.BlockRule(BLOCK, 4, 1, 2, score_every=4))])
def test_chunked_prompt_below_the_budget_follows_the_reference(tiny_llama, tmp_path, policy, rule):
    prompt = prompts(1, 300, seed=2)[0]
    got = run_vllm(tmp_path, model=str(tiny_llama), prompts=[prompt], max_tokens=100, block_size=BLOCK,
                   max_num_batched_tokens=64, budget=rule.budget * BLOCK, policy=policy,
                   score_queries=rule.score_queries, score_every=rule.score_every)
    summary = got["requests"][0]
    assert summary["evicted"], "the budget should have evicted blocks"
    model = reference_model(tiny_llama)
    assert_follows_reference(model, prompt, got["tokens"][0], rule, 64, summary)
    assert summary["most_held_decoding"] <= rule.budget
    assert summary["most_held"] <= rule.budget + 64 // BLOCK


@pytest.mark.parametrize("count,chunk,rest", [(1, 64, "prompt"), (1, 64, "off"), (2, 1024, "prompt")])
def test_recall_follows_the_reference_within_budget(tiny_llama, tmp_path, count, chunk, rest):
    """Half the budget recalls: each KV head attends, at every layer, the evicted blocks its queries
    score best, copied from the worker's cold blocks into the request's slots; the tokens follow the
    reference, which unmasks those blocks itself, and a request holds at most its budget, slots included.
    (Chunks of 64 tokens for one request; two requests read their prompts whole, so that each one's steps
    are the reference's.) With the rest on, a chunk's last queries (those that choose) attend every evicted
    block."""
    rule = reference.BlockRule(BLOCK, 4, 1, 2, recall=4, recall_queries=8, rest=rest == "prompt")
    batch = prompts(count, 330, seed=5)
    got = run_vllm(tmp_path, model=str(tiny_llama), prompts=batch, max_tokens=90, block_size=BLOCK,
                   max_num_batched_tokens=chunk, budget=8 * BLOCK, policy="h2o:sinks=1",
                   plugin={"recall": 0.5, "recall_queries": 8, "recall_rest": rest})
    model = reference_model(tiny_llama)
    for prompt, tokens, summary in zip(batch, got["tokens"], got["requests"]):
        ref = assert_follows_reference(model, prompt, tokens, rule, chunk, summary)
        assert summary["cold"] and set(summary["cold"]) == ref.evicted
        assert summary["most_held_decoding"] <= 8
    assert got["cold_total"] == 0


def test_concurrent_requests_each_follow_the_reference_within_budget(tiny_llama, tmp_path):
    rule = reference.BlockRule(BLOCK, 5, 1, 2)
    batch = prompts(3, 230, seed=3)
    got = run_vllm(tmp_path, model=str(tiny_llama), prompts=batch, max_tokens=120, block_size=BLOCK,
                   max_num_batched_tokens=1024, budget=rule.budget * BLOCK, policy="h2o:sinks=1")
    model = reference_model(tiny_llama)
    for prompt, tokens, summary in zip(batch, got["tokens"], got["requests"]):
        assert_follows_reference(model, prompt, tokens, rule, 1024, summary)
        assert summary["most_held_decoding"] <= rule.budget


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two tensor-parallel ranks need two CPUs to bind")
@pytest.mark.parametrize("budget,plugin", [(4, {}), (8, {"recall": 0.5})])
def test_two_tensor_parallel_ranks_evict_as_one(tiny_llama, tmp_path, monkeypatch, budget, plugin):
    """Each rank scores its own KV head; vLLM sums the ranks' scores and the scheduler's plan reaches
    both: the tokens and evictions equal a single rank's. With recall each rank keeps and recalls for its
    own KV head, as one rank does per head."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    prompt = prompts(1, 300, seed=2)[0]
    spec = dict(model=str(tiny_llama), prompts=[prompt, prompt[::-1]], max_tokens=60, block_size=BLOCK,
                max_num_batched_tokens=64, budget=budget * BLOCK, policy="h2o:sinks=1", plugin=plugin)
    one = run_vllm(tmp_path, **spec, tensor_parallel_size=1)
    two = run_vllm(tmp_path, **spec, tensor_parallel_size=2)
    assert two["tokens"] == one["tokens"]
    assert two["requests"] == one["requests"] and one["requests"][0]["evicted"]
