"""Run vLLM (offline, in this process) on token prompts and print what the tests compare, as JSON.

usage: run_vllm.py SPEC.json  where SPEC holds model, prompts, max_tokens, block_size,
max_num_batched_tokens and, for the plugin, budget, policy and any other option under "plugin". Each run is its own process: vLLM
keeps process-wide state that a second engine in one process would share.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its connector is readable


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    if spec.get("without_plugin"):
        os.environ["VLLM_PLUGINS"] = "none"  # load no general plugin: vLLM exactly as shipped
    from vllm import LLM, SamplingParams

    extra = {}
    if spec.get("budget") is not None:
        config = {"budget": spec["budget"]}
        if spec.get("policy"):
            config["policy"] = spec["policy"]
        if spec.get("score_queries"):
            config["score_queries"] = spec["score_queries"]
        if spec.get("score_every"):
            config["score_every"] = spec["score_every"]
        config.update(spec.get("plugin") or {})  # any other option (recall, selector, ...)
        extra["kv_transfer_config"] = {"kv_connector": "H2OConnector", "kv_role": "kv_both",
                                       "kv_connector_extra_config": config}
    llm = LLM(spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=spec.get("max_model_len", 2048), kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False, block_size=spec["block_size"], async_scheduling=False,
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=spec.get("max_num_seqs", 8),
              seed=0, tensor_parallel_size=spec.get("tensor_parallel_size", 1), **extra)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "requests": None}
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if connector is not None:
        # the engine's request id extends the one the output carries
        result["requests"] = [next((s for rid, s in connector.finished.items() if rid.startswith(o.request_id)), None)
                              for o in outputs]
        result["budget_blocks"] = connector.budget.slots
        result["cold_total"] = connector.cold_total  # every request finished: all cold blocks given back
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
