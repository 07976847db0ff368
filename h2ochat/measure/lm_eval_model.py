"""h2ochat as an lm-eval model: every request of any lm-eval task runs through a fresh H2O cache.

    python -m h2ochat.measure.lm_eval_model --model h2ochat \\
        --model_args pretrained=smollm2-135m,budget=256,policy=h2o,recall=0.5,kv_dtype=int8 \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[1024]}' --limit 2

lm-eval's own ``lm_eval`` command imports only its own model modules, so this module's ``main`` imports
the registration (``register_model("h2ochat")``) and then hands ``sys.argv`` to lm-eval's CLI unchanged;
``evaluate(...)`` does the same around ``lm_eval.simple_evaluate``. The model arguments are
``CacheSettings``' fields (policy, budget as a count, a share of the window or a size, recall, kv_dtype,
page, selector, heavy_ratio, sinks, decay, positions, ...) plus pretrained, device, dtype, prefill_chunk.

Each request gets its own cache: the context goes in through the chunked prefill (evicting as it
goes), then every generated or scored token is one decode step (evicting per token), as ``generate``
and ``eval`` run them. lm-eval's synthetic tasks (RULER) size their samples with a tokenizer they load
by name from the model arguments; the hub's loader cannot read an alias or a GGUF, so unless
``tokenizer=`` is given the model's own tokenizer is saved to a folder and passed as ``tokenizer``.
"""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import sys
import tempfile
from functools import lru_cache
from unittest import mock

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings, Sampling
from ..engine.forward_step import forward
from ..engine.generation import max_positions, prefill, sample
from ..errors import LEGACY_USER_ERRORS, UserError, one_line
from ..loading.models import load, pick_device
from .evaluation import token_nll
from .ruler import decode_through_cache

NAME = "h2ochat"
SETTINGS_FIELDS = {f.name: f.type for f in dataclasses.fields(CacheSettings)}
# what lm-eval itself passes (batch_size, max_batch_size, device) and what RULER's builders read (tokenizer)
OWN_ARGS = ("pretrained", "device", "dtype", "prefill_chunk", "tokenizer", "batch_size", "max_batch_size")


def _typed(name: str, value):
    """A model argument as its ``CacheSettings`` field takes it (lm-eval turns "256" into 256, "0.5" into 0.5)."""
    kind = SETTINGS_FIELDS[name]
    if value is None or value == "None":
        return None
    if kind.startswith("str"):
        return str(value)
    try:
        return int(value) if kind.startswith("int") else float(value)
    except (TypeError, ValueError):
        raise UserError(f"--model_args {name}={value}: expected {'an integer' if kind.startswith('int') else 'a number'}") from None


def _loaded(pretrained: str, device: str | None, dtype: str):
    """One load per model in a process: ``main`` loads it to save its tokenizer, the LM reuses it.
    lm-eval's --device defaults to cuda:0: on a machine without one, the device h2ochat picks."""
    if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
        device = "auto"
    return _load_once(str(pretrained), pick_device(str(device or "auto")), str(dtype))


def settings_from(cache_args: dict) -> CacheSettings:
    """The ``CacheSettings`` of the model arguments that are its fields; a stranger or a bad value is a UserError."""
    unknown = sorted(set(cache_args) - set(SETTINGS_FIELDS))
    if unknown:
        raise UserError(f"unknown --model_args {', '.join(unknown)}: h2ochat takes "
                        f"{', '.join(OWN_ARGS[:4] + tuple(SETTINGS_FIELDS))}")
    try:
        settings = CacheSettings(**{name: _typed(name, value) for name, value in cache_args.items()})
        settings.validate()
    except UserError:
        raise
    except ValueError as exc:
        raise UserError(f"--model_args: {one_line(exc)}") from None
    return settings


@lru_cache(maxsize=2)
def _load_once(pretrained: str, device: str, dtype: str):
    return load(pretrained, device, dtype)


@register_model(NAME)
class H2OChatLM(TemplateLM):
    """lm-eval's ``LM`` over an h2ochat model and one ``CacheSettings``; requests run one at a time."""

    def __init__(self, pretrained: str = "smollm2-135m", device: str | None = "auto", dtype: str = "auto",
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, tokenizer: str | None = None, batch_size=1,
                 max_batch_size=None, **cache_args):
        super().__init__()
        self.settings = settings_from(cache_args)
        if int(prefill_chunk) < 1:
            raise UserError(f"--model_args prefill_chunk must be at least 1, got {prefill_chunk}")
        self.chunk = int(prefill_chunk)
        self.loaded = _loaded(str(pretrained), device, str(dtype))
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.max_length = max_positions(self.model.config)
        try:  # a budget past the window, a recall count past the budget: before the first request
            self.settings.build(self.model, initial_slots=1)
        except ValueError as exc:
            raise UserError(f"--model_args: {one_line(exc)}") from None

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.loaded.name.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.loaded.device)

    # -- scoring --------------------------------------------------------------------------------------

    def continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """log p(continuation | context) through a fresh cache, and whether greedy decoding writes it:
        the context prefilled, each continuation token then fed as one decode step."""
        if self.settings.resolved_policy().grows:  # the full cache holds the window at most (lm-eval's HF rule)
            whole = (context + continuation)[-(self.max_length + 1):]
            context = whole[: len(whole) - len(continuation)] or whole[:1]
            continuation = whole[len(context):]
        cache = self.settings.build(self.model, initial_slots=len(context) + len(continuation))
        total, greedy = 0.0, True
        with torch.no_grad():
            logits = prefill(self.model, cache, self._ids(context), chunk=self.chunk)
            for index, token in enumerate(continuation):
                total -= float(token_nll(logits[:, None], self._ids([token]))[0, 0])
                greedy = greedy and int(logits.argmax(dim=-1)[0]) == token
                if index + 1 < len(continuation):
                    logits = forward(self.model, cache, self._ids([token]), logits_to_keep=1)[:, -1]
        return total, greedy

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = []
        for key, context, continuation in requests:
            result = self.continuation_logprob(list(context), list(continuation))
            self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text in lm-eval's rolling windows of the model's window (every token predicted once)."""
        results = []
        for (text,) in [request.args for request in requests]:
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(self.continuation_logprob(list(ctx), list(cont))[0] for ctx, cont in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    # -- generation -----------------------------------------------------------------------------------

    def generate_text(self, context: str, gen_kwargs: dict) -> str:
        """The answer to ``context``: greedy, or sampled at the request's temperature (top_p, top_k),
        up to ``max_gen_toks`` tokens, cut before the first of its ``until`` strings."""
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        choose = None
        if kwargs.pop("do_sample", temperature > 0) and temperature > 0:
            sampling = Sampling(temperature=temperature, top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                top_k=int(kwargs.pop("top_k", 0) or 0))
            choose = lambda logits: sample(logits, sampling)  # noqa: E731  (torch's global stream: lm-eval's --seed)
        ids = self.tok_encode(context) or [self.prefix_token_id]
        if self.settings.resolved_policy().grows:  # room for the answer in the window (lm-eval's HF rule)
            ids = ids[-max(1, self.max_length - max_new):]

        def text_of(tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def stopped(tokens: list[int]) -> bool:
            text = text_of(tokens)
            return any(stop in text for stop in until)

        out, _ = decode_through_cache(self.model, self.settings, self._ids(ids), max_new, eos_id=self.eot_token_id,
                                      chunk=self.chunk, choose=choose, done=stopped if until else None)
        text = text_of(out)
        for stop in until:
            if stop and stop in text:
                text = text[: text.index(stop)]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for request in requests:
            context, gen_kwargs = request.args
            text = self.generate_text(context, gen_kwargs)
            self.cache_hook.add_partial("generate_until", request.args, text)
            results.append(text)
        return results


def with_tokenizer(model_args: dict, device: str | None = None) -> dict:
    """``model_args`` with ``tokenizer`` set to a folder holding the model's own tokenizer, so lm-eval's
    synthetic tasks, which load theirs by name, build their samples with it (an alias such as
    smollm2-135m or a GGUF file is no name the hub's loader can read offline)."""
    if model_args.get("tokenizer"):
        return model_args
    loaded = _loaded(str(model_args.get("pretrained", "smollm2-135m")), model_args.get("device", device),
                     str(model_args.get("dtype", "auto")))
    folder = tempfile.mkdtemp(prefix="h2ochat-tokenizer-")
    atexit.register(shutil.rmtree, folder, True)
    loaded.tokenizer.save_pretrained(folder)
    return {**model_args, "tokenizer": folder}


def evaluate(tasks, model_args: dict | str = "", **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` with ``model="h2ochat"`` (its other arguments pass through)."""
    from lm_eval import simple_evaluate

    args = simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args)
    return simple_evaluate(model=NAME, model_args=with_tokenizer(args, kwargs.get("device")), tasks=tasks, **kwargs)


def _argv_with_tokenizer(argv: list[str]) -> list[str]:
    """lm-eval's command line for an h2ochat run: ``tokenizer=...`` added to ``--model_args``, and a
    ``device=`` there moved to ``--device`` (lm-eval passes its --device, cuda:0 unless given, beside
    the model arguments: both would be one argument given twice)."""
    argv = list(argv)
    model = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--model"), None)
    if model != NAME:
        return argv
    if "--model_args" not in argv or argv.index("--model_args") + 1 == len(argv):
        argv = [arg for arg in argv if arg != "--model_args"] + ["--model_args", ""]
    where = argv.index("--model_args") + 1
    args = simple_parse_args_string(argv[where])
    settings_from({key: value for key, value in args.items() if key not in OWN_ARGS})  # before the model loads
    if "device" in args:
        device = str(args.pop("device"))
        if "--device" not in argv:
            argv += ["--device", device]
    device = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--device"), None)
    if not args.get("tokenizer"):
        args = with_tokenizer(args, device)
    argv[where] = ",".join(f"{key}={value}" for key, value in args.items())
    return argv


def main(argv: list[str] | None = None) -> int:
    """``python -m h2ochat.measure.lm_eval_model <lm_eval arguments>``: lm-eval's CLI with h2ochat registered.
    A mistake in the arguments (an unknown model argument, a bad budget) is one line and exit 2."""
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv[1:] if argv is None else argv
    try:
        # lm-eval's CLI reads sys.argv (as the ``lm_eval`` command does): lend it the rewritten one
        with mock.patch.object(sys, "argv", [sys.argv[0], *_argv_with_tokenizer(argv)]):
            cli_evaluate()
    except LEGACY_USER_ERRORS as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
