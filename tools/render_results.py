"""Render docs/results.md, its plots (docs/results_*.png) and the README's results summary from the
results files (benchmarks/results_*.json, each in the envelope of benchmarks/json_report.py).

    python tools/render_results.py           # rewrite them
    python tools/render_results.py --check   # exit 1 when docs/results.md or the README summary is stale

Every figure on the page is read from a results file named beside it; the defaults and sizes are
read from the code (``CacheSettings``, the shipped model configurations). The check compares the
Markdown only: a PNG's bytes depend on the fonts of the machine that drew it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
DOCS = ROOT / "docs"
PAGE = DOCS / "results.md"
README = ROOT / "README.md"
SUMMARY_START, SUMMARY_END = "<!-- results-summary:start -->", "<!-- results-summary:end -->"
PLOTS = {"quality": "results_quality_budget.png", "recall": "results_recall_depth.png",
         "speed": "results_speed_peers.png"}
# a journal's references in recorded descriptions ("Issue 34's", "(session 69)") are left out of the page
JOURNAL = re.compile(r"\s*\(?\b(?:session|issue)s?\s*#?\d+(?:[-–]\d+)?(?:'s)?\)?", re.IGNORECASE)

# the files the page's sections read
QUALITY = ("eval_policies_tinyshakespeare", "eval_policies_gfdl")
QUALITY_POLICIES = ("full", "h2o", "mean", "tova", "decay", "sink")
RECALL_128 = ("recall_heldout_passkey_128", "recall_heldout_passkey_128_exact_s50")
RECALL_512 = "recall_heldout_passkey_512_rest_bf16_s62"
RECALL_DEFAULT = "recall_heldout_passkey_default_budget_s70"
RECALL_COST = "recall_side_by_side_s69"
QUANT = "kv_quant_eval"
PEERS = ("peers_s52_all", "peers_s53_chat", "peers_pinned_2cpus", "peers_pinned_2cpus_single", "peers_pinned_2cpus_after",
         "peers_pinned_2cpus_after_rerun", "peers_pinned_2cpus_one_pool",
         "peers_pinned_2cpus_outgrow_one_pool", "peers_pinned_2cpus_chunk_kernel",
         "peers_pinned_2cpus_chunk_kernel_rerun")
PEER_CAPTIONS = {"peers_s52_all": "Every load, every engine",
                 "peers_s53_chat": "The chat load again, once the server's mixed prefill/decode steps were the default",
                 "peers_pinned_2cpus": "Both engines pinned to the same 2 CPUs, the chat load",
                 "peers_pinned_2cpus_single": "Both engines pinned to the same 2 CPUs, one chat",
                 "peers_pinned_2cpus_after": "Both engines pinned to the same 2 CPUs, after the attention kernel took "
                                             "prompt chunks with recall in blocks of 64 tokens and a packed model kept "
                                             "its plain weights for one-row steps",
                 "peers_pinned_2cpus_after_rerun": "The same, the chat load again (the spread between two runs of one "
                                                   "commit)",
                 "peers_pinned_2cpus_one_pool": "Both engines pinned to the same 2 CPUs, once h2ochat's server computed in "
                                                "one thread only (one OpenMP pool)",
                 "peers_pinned_2cpus_outgrow_one_pool": "The same code, the outgrowing load (32 chats of 8 turns)",
                 "peers_pinned_2cpus_chunk_kernel": "Both engines pinned to the same 2 CPUs, once prompt chunks attended "
                                                    "faster (bf16 keys dotted as channel pairs, blocks of empty slots "
                                                    "not read, a chunk's dropped tokens archived alone)",
                 "peers_pinned_2cpus_chunk_kernel_rerun": "The same code, both loads again right after (the spread "
                                                          "between two runs of one commit on this shared machine)"}
PREFILL_SIDE_BY_SIDE = "prefill_side_by_side_chunk_kernel"
CHUNK_KERNEL_QUALITY = "chunk_kernel_perplexity"
MEMORY_MODELS = ("smollm2-135m", "llama-2-7b", "opt-6.7b")


def load(name: str) -> dict:
    return json.loads((BENCHMARKS / f"results_{name}.json").read_text())


def figures(name: str) -> dict:
    return load(name)["figures"]


def cite(*names: str) -> str:
    return ", ".join(f"[`results_{name}.json`](../benchmarks/results_{name}.json)" for name in names)


def scrub(text: str) -> str:
    text = JOURNAL.sub("", str(text)).strip(" ;,.")
    return text[:1].upper() + text[1:]


def first_sentence(text: str, limit: int = 140) -> str:
    text = " ".join(scrub(text).split())
    cut = re.split(r"(?<=[.:;])\s", text, maxsplit=1)[0].rstrip(".:;")
    return cut if len(cut) <= limit else cut[: limit - 1].rsplit(" ", 1)[0] + "…"


def wilson(k: int, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of k successes in n trials."""
    if not n:
        return 0.0, 1.0
    z, p = 1.959964, k / n
    centre, half = (p + z * z / (2 * n)), z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5)
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


# -- quality against the budget ------------------------------------------------------------------------
def quality_rows(name: str) -> dict[str, dict[int, float]]:
    """policy -> budget -> perplexity (the mean over the file's windows)."""
    rows: dict[str, dict[int, float]] = {}
    for entry in figures(name).get("summary") or figures(name)["results"]:
        rows.setdefault(entry["policy"], {})[entry["budget_slots"]] = entry["perplexity"]
    return rows


def quality_section() -> list[str]:
    lines = ["## Quality against the budget", "",
             "Perplexity of SmolLM2-135M (fp32, CPU) over 1,000 tokens, the mean over three windows of each text, at "
             "32-256 KV slots per layer (lower is better; `full` keeps every token). `h2o` is the default policy; "
             "`mean` holds up best at the smallest budgets.", ""]
    for name in QUALITY:
        rows = quality_rows(name)
        budgets = sorted(next(iter(rows.values())))
        text = figures(name).get("text", name)
        lines += [f"**{text}** ({cite(name)})", "", "| policy | " + " | ".join(f"{b} slots" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for policy in QUALITY_POLICIES:
            if policy in rows:
                lines.append(f"| `{policy}` | " + " | ".join(f"{rows[policy][b]:.2f}" for b in budgets) + " |")
        lines.append("")
    lines += [f"![perplexity against the KV budget]({PLOTS['quality']})", ""]
    return lines


def plot_quality(plt) -> None:
    fig, axes = plt.subplots(1, len(QUALITY), figsize=(10, 4))
    for axis, name in zip(axes, QUALITY):
        rows = quality_rows(name)
        for policy in QUALITY_POLICIES:
            if policy not in rows:
                continue
            budgets = sorted(rows[policy])
            style = dict(linestyle="--", color="black") if policy == "full" else dict(marker="o")
            axis.plot(budgets, [rows[policy][b] for b in budgets], label=policy, **style)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted(next(iter(rows.values()))), labels=[str(b) for b in sorted(next(iter(rows.values())))])
        axis.set_xlabel("KV slots per layer")
        axis.set_ylabel("perplexity")
        axis.set_title(figures(name).get("text", name))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(DOCS / PLOTS["quality"], dpi=80, metadata={"Software": None})


# -- recall against the full cache, by depth ------------------------------------------------------------
def depth_table(name: str, rows: dict[str, str]) -> dict[str, dict[float, tuple[int, int]]]:
    """label -> depth -> (recalled, trials), for the file's rows named in ``rows`` (row -> label)."""
    table: dict[str, dict[float, tuple[int, int]]] = {}
    for entry in figures(name)["summary"]:
        if entry["row"] in rows:
            table.setdefault(rows[entry["row"]], {})[entry["depth"]] = (entry["recalled"], entry["trials"])
    return table


def recall_panels() -> list[tuple[str, str, dict]]:
    full_128, recall_128 = RECALL_128
    panel_128 = {**depth_table(full_128, {"full": "full cache", "h2o 128": "h2o alone"}),
                 **depth_table(recall_128, {"h2o 128 = 64 hot + 64 recall (exact, pages of 8)": "h2o + recall"})}
    panel_512 = depth_table(RECALL_512, {"full": "full cache", "h2o 512": "h2o alone",
                                         "h2o 512 = 256 hot + 256 recall (exact, pages of 8, the rest as prompt)":
                                             "h2o + recall"})
    panel_default = depth_table(RECALL_DEFAULT, {"full": "full cache", "h2o 1638": "h2o alone",
                                                 "h2o 1638 = 822 hot + 816 recall (exact, pages of 8)": "h2o + recall"})
    return [("128 slots, ~900 tokens (fp32, 60 trials a row)", cite(*RECALL_128), panel_128),
            ("512 slots, ~3,600 tokens (bf16, 180 trials a row)", cite(RECALL_512), panel_512),
            ("1,638 slots (the default budget), 7,400 tokens (fp32, 60 trials a row)", cite(RECALL_DEFAULT), panel_default)]


def recall_section() -> list[str]:
    lines = ["## Recall against the full cache, by depth", "",
             "Pass key: a five-digit key hidden at 10%, 50% or 90% of a held-out text (a licence, a manual page, API "
             "docstrings, a changelog), the model asked for it at the end; the text is 4.5-7x the device slots. "
             "`h2o + recall` is the product's default split (half the slots recall pages of 8 tokens, the exact "
             "selector). A cell is keys found / trials; the total's bracket is the 95% Wilson interval.", ""]
    for title, source, panel in recall_panels():
        depths = sorted({d for row in panel.values() for d in row})
        lines += [f"**{title}** ({source})", "",
                  "| row | " + " | ".join(f"depth {int(d * 100)}%" for d in depths) + " | total | 95% interval |",
                  "|---|" + "---|" * (len(depths) + 2)]
        for label in ("full cache", "h2o alone", "h2o + recall"):
            cells = panel.get(label, {})
            found, trials = sum(c[0] for c in cells.values()), sum(c[1] for c in cells.values())
            low, high = wilson(found, trials)
            lines.append(f"| {label} | " + " | ".join(f"{cells[d][0]}/{cells[d][1]}" if d in cells else "-" for d in depths)
                         + f" | **{found}/{trials}** | {low:.0%}-{high:.0%} |")
        lines.append("")
    lines += [f"![keys found by depth]({PLOTS['recall']})", ""]
    return lines


def plot_recall(plt) -> None:
    panels = recall_panels()
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.8), sharey=True)
    labels = ("full cache", "h2o alone", "h2o + recall")
    for axis, (title, _, panel) in zip(axes, panels):
        depths = sorted({d for row in panel.values() for d in row})
        for index, label in enumerate(labels):
            cells = panel.get(label, {})
            rates = [cells[d][0] / cells[d][1] if d in cells else 0 for d in depths]
            axis.bar([i + (index - 1) * 0.27 for i in range(len(depths))], rates, width=0.27, label=label)
        axis.set_xticks(range(len(depths)), labels=[f"{int(d * 100)}%" for d in depths])
        axis.set_xlabel("depth of the key")
        axis.set_title(re.sub(r" \((fp32|bf16)[^)]*\)", "", title), fontsize=9)
    axes[0].set_ylabel("share of keys found")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(DOCS / PLOTS["recall"], dpi=80, metadata={"Software": None})


# -- recall's cost, quantized slots, memory ----------------------------------------------------------------
def cost_section() -> list[str]:
    f = figures(RECALL_COST)
    two, eight = f["cpu_ratios_2k"], f["cpu_ratios_8k"]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    run = f["runs_2k"][0]
    return ["## Recall's decode cost", "",
            f"A recall decode step against h2o's alone at the same device slots ({run['device_slots']} slots, "
            f"{run['recall_slots']} of them recall, pages of {run['page']}, the `{run['selector']}` selector, one "
            "sequence), their steps run in alternation, in CPU time per step: "
            f"**{median(two):.2f}x** at 2K tokens of context (median of {len(two)} runs, {min(two):.2f}-{max(two):.2f}x) "
            f"and **{median(eight):.2f}x** at 8K ({len(eight)} runs, {min(eight):.2f}-{max(eight):.2f}x) "
            f"({cite(RECALL_COST)}). The targets `h2ochat bench` reports against are 1.15x up to 2K and 1.25x up to 8K.", ""]


def quant_section() -> list[str]:
    f = figures(QUANT)
    lines = ["## Quantized slots at the same bytes", "", scrub(f.get("note", "")), "",
             "| text | `--kv-dtype` | slots | device KV bytes | perplexity (h2o) | / full cache |", "|---|---|---|---|---|---|"]
    for text, entry in f["texts"].items():
        for row in entry["rows"]:
            if row["policy"].split(" [")[0] == "h2o" and row.get("kv_bytes"):
                lines.append(f"| {text} | `{row['kv_dtype']}` | {row['kv_slots']} | {row['kv_bytes'] / 1024:.0f} KiB | "
                             f"{row['perplexity']:.2f} | {row['ratio_to_full']:.3f} |")
    lines += ["", f"Source: {cite(QUANT)}.", ""]
    return lines


def memory_rows() -> list[tuple[str, int, int, float, float, float]]:
    """(model, default slots, window, KV MiB a sequence at the default budget in bf16 and in int8, full cache bf16)."""
    sys.path.insert(0, str(ROOT))
    from h2ochat.config import CacheSettings
    from h2ochat.loading.sources import shipped_config
    from h2ochat.model_shape import ConfigOnly, max_positions

    rows = []
    for alias in MEMORY_MODELS:
        config = shipped_config(alias)
        model = ConfigOnly(config)
        slots, window = CacheSettings().slots(config), max_positions(config)
        mib = lambda kv_dtype, n: n * CacheSettings(kv_dtype=kv_dtype).slot_bytes(model) * config.num_hidden_layers / 2**20  # noqa: E731
        rows.append((alias, slots, window, mib("bfloat16", slots), mib("int8", slots), mib("bfloat16", window)))
    return rows


def memory_section() -> list[str]:
    budget = _default_budget()
    lines = ["## Memory a chat takes", "",
             f"Device KV memory of one sequence at the default budget (`--budget {budget}`: that share of the "
             "model's context window, recall slots included) against a full cache of the whole window; the "
             "per-slot score and indices are left out (computed from the code and the shipped configurations).", "",
             "| model | default slots | window | KV, bf16 | KV, int8 slots | full cache, bf16 |", "|---|---|---|---|---|---|"]
    for alias, slots, window, bf16, int8, full in memory_rows():
        lines.append(f"| {alias} | {slots} | {window} | {bf16:.1f} MiB | {int8:.1f} MiB | {full:.1f} MiB |")
    lines += ["", "With recall, evicted tokens also go to a cold store in host memory that grows with the text "
              "(`--cold-limit` bounds it).", ""]
    return lines


def _default_budget() -> str:
    sys.path.insert(0, str(ROOT))
    from h2ochat.config import CacheSettings

    return CacheSettings.budget


# -- speed against the peers ----------------------------------------------------------------------------
def peer_runs(name: str) -> list[dict]:
    return [run for run in figures(name)["runs"] if run.get("gen_tok_per_s")]


def speed_section() -> list[str]:
    lines = ["## Speed against the peers", "",
             "The OpenAI server under three loads, the same model (SmolLM2-135M) and machine (2-core AMD EPYC with "
             "AVX512-BF16, one thread per engine): `chat-8x4` (8 clients, 4 turns of ~300-token prompts, 64 tokens "
             "a reply), `single` (one chat of 4 turns), `outgrow-32x8` (32 chats of 8 turns, each history outgrowing a "
             "full-cache engine's share of the 1 GiB of KV memory every engine is given). Generated tokens per second over the whole load, time to first token (median) and "
             "peak memory; in the pinned runs (`peers.py --cpus 0,1`: both engines on the same two CPUs, two compute "
             "threads each) also the server's CPU seconds per generated token and its start to `/health` (h2ochat's "
             "compiled graphs in its cache or not, as the file's log says). No GPU run has been measured yet.", ""]
    for name in PEERS:
        e = load(name)
        skipped = ", ".join(f"{s['engine']} on {s['preset']}" if isinstance(s, dict) else str(s)
                            for s in e["figures"].get("skipped") or [])
        lines += [f"**{PEER_CAPTIONS[name]}, {str(e['date'])[:10]}** ({cite(name)}; the load average before each engine "
                  f"is in the file{'; left out: ' + skipped if skipped else ''})", "",
                  ]
        pinned = bool(e["figures"].get("cpus"))
        extra = " CPU s / token | cores busy | ready |" if pinned else ""
        lines += ["| load | engine | tokens/s | TTFT p50 | inter-token p50 | peak RSS |" + extra,
                  "|---|---|---|---|---|---|" + ("---|---|---|" if pinned else "")]
        for run in peer_runs(name):
            cells = (f" {run['server_cpu_s_per_generated_token']:.4f} | {run['server_cpu_s'] / run['wall_s']:.2f} | "
                     f"{run['ready_s']:.0f} s |" if pinned else "")
            lines.append(f"| {run['preset']} | {run['engine']} | {run['gen_tok_per_s']:.1f} | {run['ttft_p50']:.2f} s | "
                         f"{run['itl_p50'] * 1000:.0f} ms | {run['peak_rss_bytes'] / 2**30:.2f} GiB |" + cells)
        lines.append("")
    before = figures("peers_profile_chat")["engine_thread_share"]
    profile = figures("peers_profile_chat_one_pool")["engine_thread_share"]
    share = lambda key, shares=profile: f"{100 * next(v for k, v in shares.items() if k.startswith(key)):.0f}%"  # noqa: E731
    one_pool = {run["engine"] + "/" + run["preset"]: run for run in peer_runs("peers_pinned_2cpus_one_pool")}
    cpu_ratio = (one_pool["h2ochat/chat-8x4"]["server_cpu_s_per_generated_token"]
                 / one_pool["vllm/chat-8x4"]["server_cpu_s_per_generated_token"])
    lines += ["Where the pinned runs leave the targets (h2ochat's tokens/s at least vLLM's on both loads): until the "
              "server computed in one thread only, its main thread had opened an OpenMP pool of its own (the KV check "
              "before loading) before the engine thread opened the pool it computes with. With more pool threads "
              "than CPUs, libgomp's workers sleep at once after each parallel region instead of spinning, and each of "
              "a step's hundreds of regions waited for a futex wake (the engine profile of that time, "
              f"{cite('peers_profile_chat')}, put {share('compiled decode', before)} in the compiled decode step). "
              "Same machine, same pinning, the tables above: one chat went from 12.1-13.1 tokens/s to 21.0, the chat "
              "load from 32.7-40.9 to 50.7. With one pool, the engine thread during the chat "
              f"load ({cite('peers_profile_chat_one_pool')}: py-spy, idle samples included): the compiled decode step "
              f"{share('compiled decode')}, the mixed steps' linear layers {share('mixed steps: linear')}, their "
              f"attention kernel {share('mixed steps: attention')}, their Python (layers, norms, rotary, cache "
              f"bookkeeping) {share('mixed steps: other')} and recall bookkeeping {share('mixed steps: recall')}, the "
              f"decode steps' Python around the graph {share('decode steps around')}, waiting for work "
              f"{share('waiting')}. The server still spends {cpu_ratio:.1f}x vLLM's CPU seconds per generated token "
              "on the chat load: the prompt chunks' eager steps and the Python between the kernels are what is left "
              "to take.", "", *prefill_lines(),
              f"![tokens per second against the peers]({PLOTS['speed']})", ""]
    return lines


def prefill_lines() -> list[str]:
    """A served chat's later turns, prefilled under the code before and after the chunk kernel's rework."""
    report = figures(PREFILL_SIDE_BY_SIDE)
    before, after = report["trees"]
    ratio = f"cpu_{after}_over_{before}"
    lines = [f"Time to first token is mostly the prompt's prefill. A chat turn's prefill (~375 new tokens after the "
             f"history, recall at its default), the checkouts before and after the chunk kernel's rework side by side "
             f"({cite(PREFILL_SIDE_BY_SIDE)}: {report['threads']} thread, CPU seconds, medians of {report['rounds']} "
             "processes each taking turns):", "",
             f"| history + new tokens | {before} | {after} | {after} / {before} |", "|---|---|---|---|"]
    for case, row in report["cases"].items():
        lines.append(f"| {case} | {row[before]['cpu_s']:.2f} s | {row[after]['cpu_s']:.2f} s | {row[ratio]:.2f} |")
    lines += ["", "Once a history fills the policy's slots (half the budget, with recall on), a chunk attends every "
              "slot column, the recall tier's too, before pages come back to them: the kernel now skips their empty "
              "blocks instead of masking them, which is why the turn after 1,080 tokens gains most.", ""]
    quality = figures(CHUNK_KERNEL_QUALITY)
    moved = "; ".join(f"{row['dtype']} {row['text']} {row['before']:.3f} -> {row['after']:.3f}" for row in quality["rows"])
    lines += [f"Quality before and after ({cite(CHUNK_KERNEL_QUALITY)}: perplexity over {quality['tokens']:,} tokens, "
              f"budget {quality['budget']}): {moved}. {scrub(quality['note'])}. Pass keys in bf16 (60 trials a row, "
              "2,048 tokens, 128 slots): " + "; ".join(f"{row['row']}: {row['before_recalled']} found before, "
                                                      f"{row['after_recalled']} after, {row['same_answers']} answers "
                                                      "the same" for row in quality["passkey"]["rows"]) + ".", ""]
    return lines


def plot_speed(plt) -> None:
    runs = peer_runs(PEERS[0])
    presets = list(dict.fromkeys(run["preset"] for run in runs))
    engines = list(dict.fromkeys(run["engine"] for run in runs))
    fig, axis = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(engines)
    for index, engine in enumerate(engines):
        values = {run["preset"]: run["gen_tok_per_s"] for run in runs if run["engine"] == engine}
        axis.bar([i + (index - (len(engines) - 1) / 2) * width for i in range(len(presets))],
                 [values.get(p, 0) for p in presets], width=width, label=engine)
    axis.set_xticks(range(len(presets)), labels=presets)
    axis.set_ylabel("generated tokens / s")
    axis.legend()
    fig.tight_layout()
    fig.savefig(DOCS / PLOTS["speed"], dpi=80, metadata={"Software": None})


# -- every file ---------------------------------------------------------------------------------------------
def index_section() -> list[str]:
    lines = ["## Every results file", "",
             "Each file holds what was measured, the command, the commit, the machine and the date around its "
             "figures (`benchmarks/json_report.py`); \"unknown\" where the run did not record it.", "",
             "| file | what | date | commit | CPU |", "|---|---|---|---|---|"]
    for path in sorted(BENCHMARKS.glob("results_*.json")):
        e = json.loads(path.read_text())
        cpu = e["machine"].get("cpu", "unknown") if isinstance(e["machine"], dict) else e["machine"]
        what = first_sentence(e["what"]) or first_sentence(path.stem.removeprefix("results_").replace("_", " "))
        cpu = " ".join(str(cpu).split())
        lines.append(f"| [`{path.name}`](../benchmarks/{path.name}) | {what.replace('|', '/')} | "
                     f"{str(e['date'])[:10]} | `{str(e['commit'])[:12]}` | {cpu if len(cpu) <= 40 else cpu[:39] + '…'} |")
    lines.append("")
    return lines


def render_page() -> str:
    lines = ["# Results", "",
             "<!-- Generated by tools/render_results.py from benchmarks/results_*.json: do not edit by hand. -->", "",
             "Measured on CPUs (mostly a 2-core AMD EPYC with AVX512-BF16; some on other CPUs, an AVX2-only EPYC or an "
             "Intel Xeon, as each file records), with SmolLM2-135M unless a table says otherwise. The machine was often shared: speed ratios "
             "are read in CPU time or side by side, and each file says how. No GPU run has been measured yet.", "",
             "How to read the intervals: a pass-key row is a count of keys found in n trials; its 95% Wilson interval "
             "is where the true rate lies for 95% of such samples. Two rows whose intervals overlap widely are not "
             "shown to differ; trial-by-trial pairs (the same keys, texts and depths in every row) say more than the "
             "totals.", ""]
    for section in (memory_section, quality_section, recall_section, cost_section, quant_section, speed_section,
                    index_section):
        lines += section()
    return "\n".join(lines).rstrip() + "\n"


def render_summary() -> str:
    """The README's results summary: a few lines, every number from the same files as the page."""
    smollm2 = memory_rows()[0]
    ts = quality_rows(QUALITY[0])
    default_panel = recall_panels()[2][2]
    total = lambda label: tuple(map(sum, zip(*default_panel[label].values())))  # noqa: E731
    cost = figures(RECALL_COST)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    # the newest run of the chat load (the files after it may hold other loads only)
    chat = next(runs for runs in ({run["engine"]: run["gen_tok_per_s"] for run in peer_runs(name)
                                   if run["preset"] == "chat-8x4"} for name in reversed(PEERS)) if runs)
    return "\n".join([
        SUMMARY_START,
        f"- **Memory:** SmolLM2-135M at the default budget keeps {smollm2[1]} of its {smollm2[2]} positions: "
        f"{smollm2[3]:.1f} MiB of KV a conversation in bf16 ({smollm2[4]:.1f} MiB with `--kv-dtype int8`) against "
        f"{smollm2[5]:.1f} MiB for a full cache.",
        f"- **Quality:** perplexity over Tiny Shakespeare (three windows of 1,000 tokens) {ts['h2o'][128]:.2f} at 128 slots and "
        f"{ts['h2o'][256]:.2f} at 256 with `h2o`, against {ts['full'][256]:.2f} for the full cache.",
        f"- **Recall:** at the default budget, on texts 4.5x the slots, the default finds {total('h2o + recall')[0]} "
        f"of {total('h2o + recall')[1]} pass keys, the full cache {total('full cache')[0]}, h2o alone "
        f"{total('h2o alone')[0]}; a recall decode step costs {median(cost['cpu_ratios_2k']):.2f}x h2o's at 2K tokens.",
        f"- **Speed:** serving 8 chat clients on a 2-core CPU, both engines pinned to the same two CPUs, "
        f"{chat['h2ochat']:.1f} tokens/s against vLLM's {chat['vllm']:.1f}. No GPU run has been "
        "measured yet.",
        "",
        "Details, every figure's file and command: [docs/results.md](docs/results.md).",
        SUMMARY_END])


def readme_with_summary(readme: str) -> str:
    if SUMMARY_START not in readme or SUMMARY_END not in readme:
        raise SystemExit(f"README.md has no {SUMMARY_START} ... {SUMMARY_END} block")
    head, rest = readme.split(SUMMARY_START, 1)
    _, tail = rest.split(SUMMARY_END, 1)
    return head + render_summary() + tail


def main(argv: list[str]) -> int:
    page, readme = render_page(), readme_with_summary(README.read_text(encoding="utf-8"))
    if "--check" in argv:
        stale = [p.name for p, text in ((PAGE, page), (README, readme))
                 if not p.exists() or p.read_text(encoding="utf-8") != text]
        stale += [name for name in PLOTS.values() if not (DOCS / name).exists()]
        if stale:
            print(f"stale: {', '.join(stale)}: run python tools/render_results.py", file=sys.stderr)
            return 1
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "h2ochat"
    for plot in (plot_quality, plot_recall, plot_speed):
        plot(plt)
        plt.close("all")
    PAGE.write_text(page, encoding="utf-8")
    README.write_text(readme, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}, the README's summary and {len(PLOTS)} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
