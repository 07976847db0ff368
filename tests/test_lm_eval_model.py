"""h2ochat as an lm-eval model: with the full cache its log-likelihoods are the model's own masked full
attention's and its answers HF greedy generation's cut at the stop string; an evicting budget changes
them (the cache is used); the registration is lm-eval's; a bad model argument is one line."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval.api.model", reason="lm-eval (the eval extra) is not installed")

from checkpoints import write_checkpoint  # noqa: E402
from conftest import FAMILIES  # noqa: E402
from h2ochat.measure import lm_eval_model  # noqa: E402
from h2ochat.errors import UserError  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog once upon a time there was a dragon "


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    from seeds import fresh

    fresh("model")
    return write_checkpoint(tmp_path_factory.mktemp(f"lm-eval-{request.param}"), request.param,
                            max_position_embeddings=256)


def make_lm(checkpoint, **args):
    lm_eval_model._load_once.cache_clear()  # each its own load: a test that switches attention leaves no trace
    return lm_eval_model.H2OChatLM(pretrained=str(checkpoint), device="cpu", dtype="float32", **args)


@contextlib.contextmanager
def plain_attention(model):
    """The model's own (sdpa) attention over the whole sequence: the reference, no H2O cache."""
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation("h2o")


class Request:  # what lm-eval hands a model: ``args`` of an Instance
    def __init__(self, *args):
        self.args = args


def reference_logprob(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([context + continuation])
    with plain_attention(model), torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(context) - 1 : -1].double(), dim=-1)
    target = torch.tensor(continuation)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_the_full_cache_loglikelihood_is_the_models_own(checkpoint):
    lm = make_lm(checkpoint, policy="full", prefill_chunk=8)  # a prompt of several chunks
    pairs = [(TEXT * 2, " the lazy dog"), ("once upon", " a time there was"), ("", "the quick brown fox")]
    ours = lm.loglikelihood([Request(*pair) for pair in pairs], disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(pairs, ours):
        if context:
            ctx, cont = lm._encode_pair(context, continuation)
        else:  # lm-eval's rule: the prefix token stands for an empty context
            ctx, cont = [lm.prefix_token_id], lm.tok_encode(continuation)
        expected, expected_greedy = reference_logprob(lm.model, ctx, cont)
        assert logprob == pytest.approx(expected, rel=1e-4, abs=1e-4) and greedy == expected_greedy


def test_is_greedy_is_true_for_what_the_model_writes(checkpoint):
    lm = make_lm(checkpoint, policy="full")
    ids = lm.tok_encode(TEXT)
    with plain_attention(lm.model), torch.no_grad():
        written = lm.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    logprob, greedy = lm.continuation_logprob(ids, written)
    assert greedy and logprob <= 0
    assert not lm.continuation_logprob(ids, written[:-1] + [(written[-1] + 1) % len(lm.tokenizer)])[1]


def test_the_rolling_loglikelihood_predicts_every_token_once(checkpoint):
    lm = make_lm(checkpoint, policy="full")
    [rolling] = lm.loglikelihood_rolling([Request(TEXT)])
    ids = lm.tok_encode(TEXT)
    expected, _ = reference_logprob(lm.model, [lm.prefix_token_id], ids)
    assert rolling == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_generate_until_is_hf_greedy_cut_at_the_stop_string(checkpoint):
    lm = make_lm(checkpoint, policy="full", prefill_chunk=16)
    ids = lm.tok_encode(TEXT * 2)
    with plain_attention(lm.model), torch.no_grad():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                eos_token_id=lm.tokenizer.eos_token_id)
    reference = lm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert len(reference) > 6, "the fixed seed's model writes text (not the end of text at once)"
    stop = reference[len(reference) // 2 : len(reference) // 2 + 2]
    [whole, cut] = lm.generate_until([Request(TEXT * 2, {"until": [], "max_gen_toks": 20}),
                                      Request(TEXT * 2, {"until": [stop], "max_gen_toks": 20, "do_sample": False})])
    assert whole == reference
    assert cut == reference[: reference.index(stop)]


def test_an_evicting_budget_changes_the_results_on_a_long_context(checkpoint):
    full, small = make_lm(checkpoint, policy="full"), make_lm(checkpoint, policy="h2o", budget="8")
    request = [Request(TEXT * 2, " the lazy dog")]  # ~100+ tokens against 8 slots
    # a random model's distributions are near uniform: eviction moves them little, float noise far less (< 1e-4)
    assert abs(full.loglikelihood(request, disable_tqdm=True)[0][0] - small.loglikelihood(request, disable_tqdm=True)[0][0]) > 1e-2
    assert abs(full.loglikelihood_rolling([Request(TEXT)])[0] - small.loglikelihood_rolling([Request(TEXT)])[0]) > 1e-2


def test_a_sampled_answer_draws_from_torchs_seeded_stream(checkpoint):
    lm = make_lm(checkpoint, policy="h2o", budget="16")
    request = Request(TEXT, {"until": [], "max_gen_toks": 8, "temperature": 1.0, "do_sample": True})
    torch.manual_seed(3)
    first = lm.generate_until([request])
    torch.manual_seed(3)
    assert lm.generate_until([request]) == first


def test_the_model_is_in_lm_evals_registry():
    from lm_eval.api.registry import get_model

    assert get_model("h2ochat") is lm_eval_model.H2OChatLM


def test_model_args_take_cache_settings_as_lm_eval_types_them(checkpoint):
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string(f"pretrained={checkpoint},device=cpu,budget=64,policy=mean,recall=0.5,"
                                    "kv_dtype=int8,page=8,heavy_ratio=0.25")
    lm_eval_model._load_once.cache_clear()
    lm = lm_eval_model.H2OChatLM(**args)
    settings = lm.settings
    assert (settings.budget, settings.policy, settings.recall, settings.kv_dtype, settings.page, settings.heavy_ratio) == \
        ("64", "mean", "0.5", "int8", 8, 0.25)
    assert math.isfinite(lm.loglikelihood([Request(TEXT * 2, " the dog")], disable_tqdm=True)[0][0])


@pytest.mark.parametrize("args, message", [
    ({"budgit": "8"}, "unknown --model_args budgit"),
    ({"policy": "nope"}, "--model_args"),
    ({"page": "many"}, "page=many: expected an integer"),
])
def test_a_bad_model_arg_is_a_user_error(checkpoint, args, message):
    with pytest.raises(UserError, match=message.replace("-", r"\-")):
        make_lm(checkpoint, **args)


@pytest.mark.slow  # a subprocess through lm-eval's own CLI
def test_a_bad_model_arg_on_the_command_line_is_one_line(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", max_position_embeddings=256)
    result = subprocess.run([sys.executable, "-m", "h2ochat.measure.lm_eval_model", "--model", "h2ochat", "--model_args",
                             f"pretrained={folder},budgit=8", "--device", "cpu", "--tasks", "niah_single_1", "--limit", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown --model_args budgit")


def test_the_command_line_gets_the_models_tokenizer_and_one_device(checkpoint):
    from lm_eval.utils import simple_parse_args_string
    from transformers import AutoTokenizer

    lm_eval_model._load_once.cache_clear()
    argv = lm_eval_model._argv_with_tokenizer(["--model", "h2ochat", "--model_args",
                                               f"pretrained={checkpoint},device=cpu,budget=16", "--tasks", "x"])
    args = simple_parse_args_string(argv[argv.index("--model_args") + 1])
    assert "device" not in args and argv[argv.index("--device") + 1] == "cpu"  # lm-eval passes its --device beside
    tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])  # how lm-eval's RULER builders load theirs
    assert tokenizer.encode(TEXT) == lm_eval_model._loaded(str(checkpoint), "cpu", "auto").tokenizer.encode(TEXT)
    assert lm_eval_model._argv_with_tokenizer(["--model", "hf", "--model_args", "pretrained=x"])[-1] == "pretrained=x"


def test_evaluate_is_simple_evaluate_with_h2ochat_and_its_tokenizer(checkpoint, monkeypatch):
    import lm_eval

    seen = {}
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: seen.update(kwargs) or {"results": {}})
    lm_eval_model._load_once.cache_clear()
    assert lm_eval_model.evaluate(["niah_single_1"], f"pretrained={checkpoint},budget=16", device="cpu", limit=2) == \
        {"results": {}}
    assert seen["model"] == "h2ochat" and seen["tasks"] == ["niah_single_1"] and seen["limit"] == 2
    assert seen["model_args"]["budget"] == 16 and seen["model_args"]["tokenizer"]
