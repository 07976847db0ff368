"""Command-line options shared by the commands, grouped the way --help shows them."""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from .chat.settings import check_recall
from .errors import user_input
from .config import DEFAULT_PREFILL_CHUNK, CacheSettings, Sampling
from .loading.sources import DEFAULT_MODEL
from .policies import DEFAULT_POLICY, describe_policies
from .recall.selector_names import SELECTOR_HELP

MODEL, CACHE, SAMPLING, OUTPUT = "Model", "Cache", "Sampling", "Output"


@functools.cache
def declared_choices(module: str, name: str) -> tuple[str, ...]:
    """The tuple of names ``name`` that ``h2ochat.<module>`` validates an option against, read from the
    module's source: the help lists the same table the code checks, without importing torch for --help."""
    source = Path(__file__).parent.joinpath(*module.split(".")).with_suffix(".py")  # (no import: no torch)
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"{module}.{name} is not a literal tuple")  # a renamed table: the help must follow it


def one_of(module: str, name: str) -> str:
    """``a | b | c``: the choices of ``declared_choices`` as --help lists them."""
    return " | ".join(declared_choices(module, name))


def help_of(option) -> str:
    """The help text of an option declared here (an ``Annotated[..., typer.Option(...)]``)."""
    return option.__metadata__[0].help


def listed(option, lead: str) -> str:
    """The help of a comma-separated list of ``option``'s values (eval's and bench's lists): ``lead``,
    then the single option's own help, so both list the same choices; the command checks each item with
    the function the single option is checked with, so a bad item gets the same one-line error."""
    return f"{lead} Each: {help_of(option)}"


Model = Annotated[str, typer.Option("--model", "-m", envvar="H2OCHAT_MODEL", rich_help_panel=MODEL,
    help="Alias (see `h2ochat models`), hub id, local directory or .gguf file.")]
Device = Annotated[str, typer.Option(envvar="H2OCHAT_DEVICE", rich_help_panel=MODEL, help="auto | cpu | cuda.")]
Dtype = Annotated[str, typer.Option(envvar="H2OCHAT_DTYPE", rich_help_panel=MODEL,
    help="auto (bfloat16 on a CPU with native bf16, AMX or AVX512-BF16, else float32; bfloat16/float16 on GPU) | float32 | float16 | bfloat16.")]
DeviceMap = Annotated[Optional[str], typer.Option("--device-map", rich_help_panel=MODEL,
    help="'auto' splits a large model across GPUs / CPU (accelerate); the cache follows each layer.")]

def budget_help(fraction_of: str, whole: str = "", fits_at: str = "--kv-dtype") -> str:
    """--budget's help, one text for every command: what a fraction is of is the one thing that differs
    (the context window for the commands that chat or generate; the text measured for eval, each
    context for bench), and each command's help says which."""
    return (f"KV slots per layer: a fraction of {fraction_of} written with a point (0.2{whole}), a slot count written "
            "as an integer (512; '1' is one slot), or the device KV bytes per sequence (16MiB, 512KiB, 1.5GiB: every "
            f"layer and KV head, codes and scales counted), turned into the slots that fit at {fits_at}.")


Budget = Annotated[str, typer.Option("--budget", "-b", envvar="H2OCHAT_BUDGET", rich_help_panel=CACHE,
    help=budget_help("the context window", ", 1.0 = the whole window"))]
KvDtype = Annotated[str, typer.Option("--kv-dtype", envvar="H2OCHAT_KV_DTYPE", rich_help_panel=CACHE,
    help="How the slots hold keys and values: " + one_of("kv.slot_format", "KV_DTYPES") + ". auto: the model's "
         "dtype; float32, bfloat16, float16 and fp8 (float8_e4m3fn): a cast; int8 and int4: codes with a float32 "
         "scale and offset per token and KV head (int4 keys rotated first). At head dim 64 a slot of int8 takes "
         "3.6x fewer bytes than float32 (1.8x fewer than bfloat16), int4 6.4x (3.2x), fp8 4x (2x).")]
Policy = Annotated[str, typer.Option("--policy", "-p", envvar="H2OCHAT_POLICY", rich_help_panel=CACHE,
    help="Eviction policy (knobs may follow: name:decay=0.9:sinks=4): "
         + "; ".join(f"{name} = {summary}" for name, summary in describe_policies()) + ".")]
HeavyRatio = Annotated[Optional[float], typer.Option("--heavy-ratio", rich_help_panel=CACHE,
    help="Share of the non-sink slots kept on merit (heavy hitters); the rest is the recent window. "
         "Default: the policy's own (0.5 for h2o).")]
Sinks = Annotated[Optional[int], typer.Option("--sinks", rich_help_panel=CACHE,
    help="First tokens never evicted. Default: the policy's own (0 for h2o, 4 for sink and the newer policies).")]
Decay = Annotated[Optional[float], typer.Option("--decay", rich_help_panel=CACHE,
    help="Score update S <- decay * S + attention: 1 = the paper's sum, 0 = this step only. Default: the policy's own.")]
Positions = Annotated[str, typer.Option("--positions", rich_help_panel=CACHE,
    help="compact: re-number cached tokens when the model's position limit is reached, so generation goes on "
         "forever; absolute: keep original positions and stop at the limit (the paper's behaviour).")]
Recall = Annotated[Optional[str], typer.Option("--recall", rich_help_panel=CACHE,
    help="Two tiers: R of the budget's slots hold evicted tokens recalled from a cold store when the query wants "
         "them (a slot count, 64, or a share of the budget written with a point, 0.5); auto: half the slots once the "
         "budget holds 128 (the default of run, story, generate and serve); 0: no recall (the default of bench).")]
Page = Annotated[int, typer.Option("--page", min=1, rich_help_panel=CACHE,
    help="With --recall: evicted tokens move to the cold store and back in pages of this many tokens.")]
Selector = Annotated[str, typer.Option("--selector", rich_help_panel=CACHE,
    help="With --recall: how the pages to recall are chosen: " + SELECTOR_HELP + ".")]
ColdDtype = Annotated[str, typer.Option("--cold-dtype", rich_help_panel=CACHE,
    help="With --recall: " + one_of("recall.cold_store", "COLD_DTYPES") + ". The cold store keeps keys and values "
         "at the model's dtype (model), the values as int8 codes (int8-values), those and the keys in bf16 "
         "(bf16-keys), or both as int8 codes (int8); auto: bf16-keys for an fp32 model, else int8-values.")]
ColdLimit = Annotated[Optional[int], typer.Option("--cold-limit", min=1, rich_help_panel=CACHE,
    help="With --recall: tokens per layer and KV head the cold store keeps (the oldest go). Default: all.")]
RecallEvery = Annotated[int, typer.Option("--recall-every", min=1, rich_help_panel=CACHE,
    help="With --recall: decode steps between two recalls (prompt chunks always recall).")]
RecallDecodeRule = Annotated[str, typer.Option("--recall-decode-rule", rich_help_panel=CACHE,
    help="With --recall: " + one_of("recall.tiered", "DECODE_RULES") + ". When a decode step chooses its pages: "
         "in-step (with its own queries; every eager step, CPU or GPU, and a CPU's compiled step) or before (before "
         "the step, with the last step's queries: what a captured graph needs).")]
RecallRest = Annotated[str, typer.Option("--recall-rest", rich_help_panel=CACHE,
    help="With --recall: " + one_of("recall.tiered", "REST_MODES") + ". The cold pages a step does not recall are "
         "left out of its attention (off) or still attended, one column for all of them (pages: each page's exact "
         "weight and mean value; every cold key read every step; eager steps only). prompt: in prompt chunks "
         "only, so decode steps cost what off's do. auto (the default): prompt's, on every machine "
         "(computed by the recall step's C kernel where it runs, else by the torch route: slower, the same tokens).")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk", min=1, rich_help_panel=CACHE,
    help="Prompt tokens fed per forward; peak KV memory is slots + chunk whatever the prompt length.")]

Temperature = Annotated[float, typer.Option("--temperature", "-t", min=0.0, rich_help_panel=SAMPLING, help="0 = greedy.")]
TopP = Annotated[float, typer.Option("--top-p", rich_help_panel=SAMPLING, help="Nucleus sampling threshold.")]
TopK = Annotated[int, typer.Option("--top-k", min=0, rich_help_panel=SAMPLING, help="Sample among the k best (0 = all).")]
Seed = Annotated[Optional[int], typer.Option("--seed", rich_help_panel=SAMPLING, help="Seed for sampling and the random policy.")]
RepetitionPenalty = Annotated[float, typer.Option("--repetition-penalty", "--repeat-penalty", rich_help_panel=SAMPLING,
    help="Above 1 makes tokens already in the text less likely (about 1.1 stops small models looping; 1 = off).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, rich_help_panel=SAMPLING, help="Tokens to generate at most.")]
Json = Annotated[bool, typer.Option("--json", rich_help_panel=OUTPUT, help="Print one JSON object instead of text.")]


def cache_settings(policy: str, budget: str, heavy_ratio: float | None, sinks: int | None, positions: str,
                   seed: int | None, decay: float | None = None, kv_dtype: str = "auto", **recall) -> CacheSettings:
    """``recall``: the two-tier fields (recall, page, selector, cold_dtype, cold_limit, recall_every,
    recall_decode_rule, recall_rest)."""
    return checked_cache(policy=policy, budget=budget, heavy_ratio=heavy_ratio, sinks=sinks, decay=decay,
                         positions=positions, seed=seed, kv_dtype=kv_dtype, **recall)


def fits_window(settings: CacheSettings):
    """``models.load(check_config=...)``: the budget against the model's context window (and the
    policy's split against its depth), from the configuration alone, before the weights load."""
    from types import SimpleNamespace

    from .chat.settings import check_fits

    return lambda config: check_fits(settings, SimpleNamespace(config=config))  # it reads model.config only


def sampling(temperature: float, top_p: float, top_k: int, seed: int | None, repetition_penalty: float = 1.0) -> Sampling:
    settings = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, repetition_penalty=repetition_penalty)
    with user_input():
        settings.validate()
    return settings


DEFAULTS = dict(model=DEFAULT_MODEL, device="auto", dtype="auto", budget="0.2", policy=DEFAULT_POLICY, heavy_ratio=None,
                sinks=None, positions="compact", prefill_chunk=DEFAULT_PREFILL_CHUNK, temperature=0.0, top_p=1.0, top_k=0,
                # the two-tier options' defaults are CacheSettings' own: one place to change them
                **{name: getattr(CacheSettings, name) for name in ("page", "selector", "cold_dtype", "recall_every",
                                                               "recall_decode_rule", "recall_rest")})


# the two-tier options, as CacheSettings names them: (annotation, default)
RECALL_OPTIONS = {"recall": (Recall, None), "page": (Page, DEFAULTS["page"]), "selector": (Selector, DEFAULTS["selector"]),
                  "cold_dtype": (ColdDtype, DEFAULTS["cold_dtype"]), "cold_limit": (ColdLimit, None),
                  "recall_every": (RecallEvery, DEFAULTS["recall_every"]),
                  "recall_decode_rule": (RecallDecodeRule, DEFAULTS["recall_decode_rule"]),
                  "recall_rest": (RecallRest, DEFAULTS["recall_rest"])}

# every CacheSettings field a command line sets (all but the seed, which is the sampling's --seed), in
# the order --help lists them; the defaults are the dataclass's (``takes_cache_options``)
CACHE_OPTIONS = {"budget": Budget, "policy": Policy, "heavy_ratio": HeavyRatio, "sinks": Sinks, "decay": Decay,
                 "positions": Positions, "kv_dtype": KvDtype,
                 **{name: annotation for name, (annotation, _) in RECALL_OPTIONS.items()}}
PREFILL_CHUNK = inspect.Parameter("prefill_chunk", inspect.Parameter.KEYWORD_ONLY, annotation=PrefillChunk,
                                  default=DEFAULT_PREFILL_CHUNK)


def _replace_parameters(command, replaced: dict[str, list[inspect.Parameter]]):
    """``command``'s signature with each parameter named in ``replaced`` swapped for the given ones,
    where it stood and of its kind (typer lists a panel's options in signature order)."""
    signature = inspect.signature(command, eval_str=True)  # the command's own annotations, resolved
    parameters = []
    for parameter in signature.parameters.values():
        parameters.extend(new.replace(kind=parameter.kind) for new in replaced.get(parameter.name, [parameter]))
    return signature.replace(parameters=parameters)


def takes_recall_options(command=None, *, recall: str | None = "auto"):
    """Give a typer command --recall, --page, --selector, --cold-dtype, --cold-limit, --recall-every and
    --recall-decode-rule without restating them in its signature: it receives them as one ``recall_options`` dict (keyword
    arguments of ``cache_settings``). ``recall``: the command's --recall default (``auto``, recall by
    default: ``recall.default``; None: off unless asked, as ``bench`` is)."""
    if command is None:
        return functools.partial(takes_recall_options, recall=recall)
    defaults = {**{name: default for name, (_, default) in RECALL_OPTIONS.items()}, "recall": recall}
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=defaults[name])
             for name, (annotation, _) in RECALL_OPTIONS.items()]

    @functools.wraps(command)
    def with_recall_options(*args, **kwargs):
        options = {name: kwargs.pop(name) for name in RECALL_OPTIONS}
        return command(*args, recall_options=options, **kwargs)

    with_recall_options.__signature__ = _replace_parameters(command, {"recall_options": added})
    return with_recall_options


def takes_cache_options(command=None, *, budget: str = CacheSettings.budget):
    """Give a typer command every cache option, declared once here from ``CacheSettings``' fields
    (``CACHE_OPTIONS``, defaults the dataclass's) and --prefill-chunk: they stand where the command's
    ``settings`` and ``prefill_chunk`` parameters stand, and the command receives ``settings``, a checked
    ``CacheSettings`` (a bad value is one line before anything loads; its seed is the command's --seed
    when it has one), and ``prefill_chunk``. ``budget``: this command's default. --recall's is ``auto`` for every
    command that takes these options (recall by default: ``recall.default``), where the dataclass's, for callers
    of the library, is None (no recall)."""
    if command is None:
        return functools.partial(takes_cache_options, budget=budget)
    defaults = {**{name: getattr(CacheSettings, name) for name in CACHE_OPTIONS}, "budget": budget, "recall": "auto"}
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=defaults[name])
             for name, annotation in CACHE_OPTIONS.items()]

    @functools.wraps(command)
    def with_cache_options(*args, **kwargs):
        options = {name: kwargs.pop(name) for name in CACHE_OPTIONS}
        return command(*args, settings=checked_cache(seed=kwargs.get("seed"), **options), **kwargs)

    # --prefill-chunk after --kv-dtype, before the recall options, as --help has always listed them
    added.insert(list(CACHE_OPTIONS).index("kv_dtype") + 1, PREFILL_CHUNK)
    with_cache_options.__signature__ = _replace_parameters(command, {"settings": added, "prefill_chunk": []})
    return with_cache_options


def checked_cache(**fields) -> CacheSettings:
    """CacheSettings of the options as typed, checked: a bad one is the user's to fix (UserError)."""
    settings = CacheSettings(**fields)
    with user_input():
        settings.validate()
    check_recall(settings)
    return settings


def _at_most_the_cpus(count: int | None) -> int | None:
    """--threads / H2OCHAT_THREADS read: refused above the CPUs while the options are parsed, before torch."""
    from .threads import check_count

    try:
        return None if count is None else check_count(count, "")
    except ValueError as exc:
        raise typer.BadParameter(str(exc).strip()) from None


Threads = Annotated[Optional[int], typer.Option("--threads", min=1, envvar="H2OCHAT_THREADS", rich_help_panel=MODEL,
    callback=_at_most_the_cpus,
    show_default="the idle physical cores",
    help="CPU threads torch computes with. Default: OMP_NUM_THREADS if set, else the physical cores less those "
         "other jobs keep busy (the load average), at least 1: a thread whose core is taken stalls every step.")]


def takes_threads(command):
    """Give a typer command --threads and set the thread count (h2ochat.threads.apply) before its body
    runs; the command's own signature stays as it is."""
    signature = inspect.signature(command, eval_str=True)
    threads_parameter = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, annotation=Threads, default=None)

    @functools.wraps(command)
    def with_threads(*args, **kwargs):
        from . import threads
        from .errors import fail

        try:
            threads.apply(kwargs.pop("threads"))
        except ValueError as exc:  # OMP_NUM_THREADS above the CPUs (--threads was checked when parsed)
            raise fail(str(exc)) from None
        return command(*args, **kwargs)

    with_threads.__signature__ = signature.replace(parameters=[*signature.parameters.values(), threads_parameter])
    return with_threads


RandomWeights = Annotated[bool, typer.Option("--random-weights", rich_help_panel=MODEL,
    help="Build the model from its configuration (shipped with the aliases marked in `h2ochat models`, or a "
         "directory's config.json) with random weights: no download, for timing (speed does not depend on the "
         "values). Text goes through a byte-level tokenizer and comes out as noise.")]


ServeCompile = Annotated[Optional[bool], typer.Option("--compile/--no-compile", rich_help_panel=MODEL,
    help="Compile the decode step with torch.compile while the server loads (default: on, recall included on a "
         "CPU, where the graph chooses a step's pages with its own queries as an eager step does; off with recall "
         "on a GPU, and for the random and full policies, whose steps the graph does not cover): on a CPU a graph "
         "for one row and one for every larger row bucket (on CUDA one per bucket), minutes on a CPU the first "
         "time, less once inductor's cache holds them (the server's start-up line says how they went). "
         "Where compiling fails (no C++ compiler), the server says so and decodes eagerly.")]

ServeMixedSteps = Annotated[bool, typer.Option("--mixed-steps/--no-mixed-steps", rich_help_panel=MODEL,
    help="Read a waiting prompt's chunk and decode the running rows in one forward, so the linear layers read "
         "the weights once for both (vLLM's chunked prefill; measured on a CPU chat load: +11% tokens/s with the "
         "compiled step, about even with the eager one). --no-mixed-steps runs them one after the other.")]

Compile = Annotated[bool, typer.Option("--compile", rich_help_panel=MODEL,
    help="Compile the decode step with torch.compile (inductor on the CPU, CUDA graphs on a GPU); prefill stays "
         "eager. The first generated token waits for the compilation (a minute or more on a CPU). The random "
         "and full policies run eagerly.")]
