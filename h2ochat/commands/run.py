"""`h2ochat run`: the interactive chat, streaming replies with the cache's state under them."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

import h2ochat_prompts

from .. import options as o
from ..chat import ChatSettings, Conversation
from ..errors import user_errors
from ..models import load
from ..repl import PromptReader, Repl, StreamReader, history_path
from ..ui import make_console


def loading(console, name: str):
    """A spinner while the model loads (a terminal only)."""
    from contextlib import nullcontext

    return console.status(f"loading {name}…") if console.is_terminal else nullcontext()


@user_errors
def run(
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    budget: o.Budget = "0.2",
    policy: o.Policy = "h2o",
    heavy_ratio: o.HeavyRatio = 0.5,
    sinks: o.Sinks = 4,
    positions: o.Positions = "compact",
    prefill_chunk: o.PrefillChunk = o.DEFAULTS["prefill_chunk"],
    system: Annotated[Optional[str], typer.Option("--system", "-s", envvar="H2OCHAT_SYSTEM", rich_help_panel=o.SAMPLING,
        help="System prompt: text, or the name of a file in prompts/ (e.g. 'concise').")] = None,
    temperature: o.Temperature = 0.7,
    top_p: o.TopP = 1.0,
    top_k: o.TopK = 0,
    seed: o.Seed = None,
    repetition_penalty: o.RepetitionPenalty = 1.0,
    max_new_tokens: o.MaxNewTokens = 512,
):
    """Chat with a model through the H2O cache. /help inside lists the commands."""
    settings = ChatSettings(system=h2ochat_prompts.system_prompt(system) if system else None,
                            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            repetition_penalty=repetition_penalty,
                            max_new_tokens=max_new_tokens,
                            cache=o.cache_settings(policy, budget, heavy_ratio, sinks, positions, seed))
    settings.validate()  # bad values fail before the model loads
    console = make_console()
    with loading(make_console(stderr=True), model):
        loaded = load(model, device, dtype, device_map)
    conversation = Conversation(loaded.model, loaded.tokenizer, settings, prefill_chunk=prefill_chunk)
    interactive = sys.stdin.isatty()
    if interactive:
        budget_split = conversation.cache.budget
        console.print(f"[bold]h2ochat[/] · {loaded.name} · {policy} cache of {budget_split.slots} slots "
                      f"({budget_split.heavy} heavy + {budget_split.recent} recent) of a "
                      f"{conversation.max_positions}-token context · [dim]/help for commands, /bye to leave[/]")
    repl = Repl(conversation, console, read_line=lambda prompt: "", model_name=loaded.name)
    repl.read_line = PromptReader(repl.toolbar, history_path()) if interactive else StreamReader(sys.stdin)
    code = repl.run()
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
