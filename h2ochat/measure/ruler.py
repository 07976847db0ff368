"""RULER's synthetic long-context tasks, built by lm-eval's own RULER builders with the model's
tokenizer, generated through h2ochat's cache and scored as lm-eval scores them.

Only the five tasks whose builders need no download are offered (``TASKS``): the others read Paul
Graham's essays or SQuAD from the hub. Each sample is lm-eval's: its ``input`` (the prompt, sized to
``length`` tokens with the answer's room), ``gen_prefix`` (appended after a space, as lm-eval does for a
model without a chat template), ``outputs`` (the expected strings) and the task's ``max_gen_toks``.
The answer is greedy, through the row's ``H2OCache``: the prompt's chunked prefill evicts as it goes,
then each decode step, up to ``max_gen_toks`` tokens or the end-of-text token. The score is RULER's
``string_match_all`` (the share of expected strings found in the answer, case-insensitive), lm-eval's
own function when it is installed (``pip install -e ".[eval]"``), else ``string_match_all`` below,
which follows it."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..engine.generation import DEFAULT_PREFILL_CHUNK, forward, prefill

# task -> (builder, its arguments, max_gen_toks), as lm-eval 0.4.13's tasks/ruler/*.yaml and *_utils.py set them
TASKS = {
    "niah_single_1": ("niah", {"type_haystack": "repeat", "type_needle_k": "words", "type_needle_v": "numbers"}, 128),
    "niah_multikey_2": ("niah", {"type_haystack": "needle", "type_needle_k": "words", "type_needle_v": "numbers"}, 128),
    "niah_multikey_3": ("niah", {"type_haystack": "needle", "type_needle_k": "uuids", "type_needle_v": "uuids"}, 128),
    "ruler_vt": ("vt", {}, 30),
    "ruler_cwe": ("cwe", {}, 120),
}
INSTALL = 'pip install -e ".[eval]"'


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the max_seq_length asked of the builder
    index: int
    prompt: str  # input, then " " and the gen_prefix
    outputs: tuple[str, ...]
    max_new_tokens: int


def parse_tasks(text: str) -> list[str]:
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    if not names:
        raise ValueError("--ruler-tasks needs at least one task")
    for name in names:
        if name not in TASKS:
            raise ValueError(f"unknown RULER task {name!r}: choose from {', '.join(TASKS)} (the ones that build offline)")
    return list(dict.fromkeys(names))


def check_lm_eval() -> None:
    try:
        import lm_eval.tasks.ruler.common_utils  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--task ruler builds its samples with lm-eval's RULER tasks ({exc.name} is missing): "
                         f"{INSTALL}") from None


def shortest_vt_prompt(tokenizer, example: dict) -> int:
    """Tokens of the shortest prompt lm-eval's vt builder tries (ten noise sentences, one chain of four
    hops: its defaults), with the in-context example and the 30 answer tokens it reserves, plus a margin
    for the random names' and numbers' tokens. Draws from Python's random: call it before a sample is seeded."""
    from lm_eval.tasks.ruler import vt_utils

    text, answer = vt_utils.generate_input_output(10, 1, 4)
    example_text = example["input"] + " " + " ".join(example["outputs"]) + "\n\n"
    # counted as the builder counts its first try: the text with its answer list printed after it
    return len(tokenizer(f"{text} {answer}").input_ids) + len(tokenizer(example_text).input_ids) + 30 + 16


def build_samples(tokenizer, task: str, length: int, count: int, seed: int = 42) -> list[Sample]:
    """``count`` samples of ``task`` at ``length`` tokens from lm-eval's builder. Sample ``i`` is built
    alone from its own seed (``seed + i``): lm-eval's builders draw every sample from one stream, and the
    NIAH-single and CWE builders size the haystack by a search whose draws depend on ``count``, so
    sample 3 of 5 and sample 3 of 25 differed, and a log grown with another ``--samples`` would have
    scored different prompts under one key. The vt builder's in-context example is drawn once from
    ``seed``, as lm-eval draws it once per task."""
    check_lm_eval()
    kind, arguments, max_new = TASKS[task]
    import contextlib
    import io

    import numpy as np

    def seeded(value: int) -> None:  # vt and cwe draw from Python's random, as lm-eval leaves it
        random.seed(value)
        np.random.seed(value)

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # their imports try nltk's punkt (not needed here) and their loops print sizes and progress bars
        if kind == "niah":
            from lm_eval.tasks.ruler import niah_utils, prepare_niah

            haystack = prepare_niah.get_haystack(type_haystack=arguments["type_haystack"])

            def one(index: int) -> dict:
                seeded(seed + index)
                return prepare_niah.generate_samples(haystack, TOKENIZER=tokenizer, max_seq_length=length,
                                                     template=niah_utils.TEMPLATE, num_samples=1,
                                                     random_seed=seed + index, **arguments)[0]
        elif kind == "vt":
            from lm_eval.tasks.ruler import vt_utils

            seeded(seed)
            example = vt_utils.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500,
                                                           incremental=5)[0]
            # lm-eval's builder retries forever when its shortest prompt (the example and ten noise
            # sentences) does not fit: refuse such a length instead of hanging
            shortest = shortest_vt_prompt(tokenizer, example)
            if shortest > length:
                raise ValueError(f"ruler_vt needs --lengths of at least {shortest} tokens with this tokenizer "
                                 f"(its in-context example and shortest chain), not {length}")

            def one(index: int) -> dict:
                seeded(seed + index)
                return vt_utils.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1,
                                                            max_seq_length=length, icl_example=example)[0]
        else:
            from lm_eval.tasks.ruler import cwe_utils

            def one(index: int) -> dict:
                seeded(seed + index)
                cwe_utils.RNG.seed(seed + index)  # its own generator, which earlier samples had drawn from
                return cwe_utils.sys_word_pair_random(num_samples=1, max_seq_length=length, tokenizer=tokenizer)[0]

        docs = [one(index) for index in range(count)]
    if any(not doc["outputs"] for doc in docs):  # cwe's builder finds no common words in a short list
        raise ValueError(f"{task} builds samples with nothing to find at {length} tokens: use a longer --lengths")
    return [Sample(task, length, index, doc["input"] + " " + doc["gen_prefix"], tuple(doc["outputs"]), max_new)
            for index, doc in enumerate(docs)]


def clean(prediction: str) -> str:
    """lm-eval's RULER post-processing: strip, control characters become newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, outputs: Sequence[str]) -> float:
    """The share of ``outputs`` found in ``prediction``, case-insensitive (RULER's metric)."""
    try:
        from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all as theirs
    except ImportError:
        text = clean(prediction).lower()
        return sum(out.lower() in text for out in outputs) / len(outputs)
    return float(theirs(postprocess_pred([prediction]), [list(outputs)]))


def decode_through_cache(model, settings, ids: torch.Tensor, max_new_tokens: int, *, eos_id: int | None,
                         chunk: int = DEFAULT_PREFILL_CHUNK, choose=None, done=None) -> tuple[list[int], bool]:
    """Prefill ``ids`` [1, T] into a fresh cache of ``settings`` (a ``CacheSettings``; the chunked
    prefill evicts as it goes), then decode up to ``max_new_tokens`` tokens, one cache step each, until
    ``eos_id``. ``choose(logits [1, V]) -> [1]`` picks each token (default: greedy); ``done(tokens)``,
    asked after each token, ends the answer early. Returns the tokens and whether ``done`` ended it.
    The one decode loop of ``generate`` here and of the lm-eval model (``lm_eval_model``)."""
    cache = settings.build(model, initial_slots=ids.shape[1] + max_new_tokens)
    with torch.no_grad():
        logits = prefill(model, cache, ids, chunk=chunk)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = choose(logits) if choose is not None else logits.argmax(dim=-1)
            if int(token[0]) == eos_id:
                break
            out.append(int(token[0]))
            if done is not None and done(out):
                return out, True
            if len(out) < max_new_tokens:
                logits = forward(model, cache, token.view(1, 1), logits_to_keep=1)[:, -1]
    return out, False


def generate(model, tokenizer, settings, prompt: str, max_new_tokens: int,
             chunk: int = DEFAULT_PREFILL_CHUNK, outputs: Sequence[str] = ()) -> tuple[str, bool]:
    """Greedy answer to ``prompt`` through a fresh cache of ``settings`` (a ``CacheSettings``), and
    whether it stopped early: once every one of ``outputs`` is in the answer, the score is 1 whatever
    follows (a found string stays found in a longer answer), so the remaining tokens are not spent.
    lm-eval generates on to ``max_new_tokens``; the score is the same, the logged answer shorter."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(next(model.parameters()).device)

    def found(tokens: list[int]) -> bool:
        return string_match_all(tokenizer.decode(tokens, skip_special_tokens=True), outputs) == 1.0

    out, early = decode_through_cache(model, settings, ids, max_new_tokens, eos_id=tokenizer.eos_token_id,
                                      chunk=chunk, done=found if outputs else None)
    return tokenizer.decode(out, skip_special_tokens=True), early and len(out) < max_new_tokens


def run_sample(model, tokenizer, row, sample: Sample) -> dict:
    """One scored sample on one cache row (``passkey.CacheRow``): its log record."""
    started = time.perf_counter()
    answer, early = generate(model, tokenizer, row.settings, sample.prompt, sample.max_new_tokens, chunk=row.chunk,
                             outputs=sample.outputs)
    return {"row": row.label, "task": sample.task, "length": sample.length, "sample": sample.index,
            "answer": answer, "outputs": list(sample.outputs), "stopped_when_found": early,
            "score": string_match_all(answer, sample.outputs), "seconds": round(time.perf_counter() - started, 2)}
