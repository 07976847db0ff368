"""`h2ochat run`: the interactive chat, streaming replies with the cache's state under them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import options as o
from ..config import DEFAULT_PREFILL_CHUNK, CacheSettings
from ..chat.settings import ChatSettings, check_recall
from ..errors import UserError, strict_user_errors
from .common import RepeatLastN, compiling_note, loading

# the chat, the model loader and the REPL are imported when the command runs (--help stays fast)

CHAT = ChatSettings()  # the options' defaults are the chat settings' own


def given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was set on the command line or through its environment variable."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def resumed_settings(ctx: typer.Context, stored: dict, typed: ChatSettings) -> ChatSettings:
    """The stored conversation's settings, with the options given on this command line on top (every
    setting is a run() option of the same name: tests/test_settings_fields.py holds them to it)."""
    from ..chat.settings import SETTINGS

    given_here = {name: typed.get(name) for name in SETTINGS if given(ctx, name)}
    settings = ChatSettings.from_json(stored).with_values(given_here)
    settings.validate()
    check_recall(settings.cache)
    return settings


def model_reference(model: str) -> str:
    """What to load this model by next time: an absolute path for a local directory or file."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


@strict_user_errors
@o.takes_cache_options
def run(
    ctx: typer.Context,
    model: o.Model = o.DEFAULTS["model"],
    device: o.Device = "auto",
    dtype: o.Dtype = "auto",
    device_map: o.DeviceMap = None,
    settings: CacheSettings = None,  # the cache options and --prefill-chunk, checked (o.takes_cache_options)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    system: Annotated[Optional[str], typer.Option("--system", "-s", envvar="H2OCHAT_SYSTEM", rich_help_panel=o.SAMPLING,
        help="System prompt: text, or the name of a file in prompts/ (e.g. 'concise').")] = None,
    temperature: o.Temperature = CHAT.sampling.temperature,
    top_p: o.TopP = CHAT.sampling.top_p,
    top_k: o.TopK = CHAT.sampling.top_k,
    seed: o.Seed = CHAT.sampling.seed,
    repetition_penalty: o.RepetitionPenalty = CHAT.sampling.repetition_penalty,
    repeat_last_n: RepeatLastN = CHAT.sampling.repeat_last_n,
    max_new_tokens: o.MaxNewTokens = CHAT.max_new_tokens,
    resume_last: Annotated[bool, typer.Option("--continue", "-c", rich_help_panel=o.OUTPUT,
        help="Resume the most recent conversation (its model and settings; options given here win).")] = False,
    conversation_id: Annotated[Optional[str], typer.Option("--conversation", rich_help_panel=o.OUTPUT,
        help="Resume this conversation (an id from `h2ochat history`, or its first characters).")] = None,
    no_history: Annotated[bool, typer.Option("--no-history", rich_help_panel=o.OUTPUT,
        help="Do not keep this conversation (by default every turn is written under the h2ochat home).")] = False,
    compile: o.Compile = False,
):
    """Chat with a model through the H2O cache. /help inside lists the commands."""
    import h2ochat_prompts

    from ..chat import history
    from ..chat.conversation import Conversation
    from ..loading.models import load
    from ..chat.repl import PromptReader, Repl, StreamReader, history_path
    from ..console import make_console

    if no_history and (resume_last or conversation_id is not None):
        raise UserError(f"--no-history starts a conversation that is not kept; {'--continue' if resume_last else '--conversation'} "
                        "resumes a kept one and keeps its new turns: give one or the other")
    # every setting is an option of the same name (tests/test_settings_fields.py); bad values fail here,
    # before the model loads
    # (``settings``, the cache's, is checked already; the chat's are read from the same options)
    settings = ChatSettings.from_options({**ctx.params, "system": h2ochat_prompts.system_prompt(system) if system else None})
    check_recall(settings.cache)
    log, messages = None, []
    if resume_last or conversation_id is not None:
        if resume_last and conversation_id is not None:
            raise UserError("give --continue or --conversation ID, not both")
        # read and check the stored conversation before loading a model for it
        log, data = history.ConversationLog.resume(history.find(conversation_id), model)
        settings = resumed_settings(ctx, data.get("settings") or {}, settings)
        if data.get("model") and not given(ctx, "model"):
            model = str(data["model"])
            log.for_model(model)
        messages = data["messages"]
    console, err = make_console(), make_console(stderr=True)
    with loading(err, model):
        loaded = load(model, device, dtype, device_map, kv_slots=settings.cache.kv_slots_needed(prefill_chunk))
    conversation = Conversation(loaded.model, loaded.tokenizer, settings, prefill_chunk=prefill_chunk, compile=compile)
    if compile:
        err.print(f"note: {compiling_note()} (the first reply only)", style="dim", markup=False, highlight=False)
    if no_history:
        log = None
    elif log is None:
        log = history.ConversationLog(model_reference(model))
    else:
        log.for_model(model_reference(model))
    interactive = sys.stdin.isatty()
    if interactive:
        from rich.text import Text

        from ..chat.split import describe_slots, planned_split

        console.print(Text.assemble(("h2ochat", "bold"), f" · {loaded.name} · {settings.cache.policy} cache of "
                                    f"{describe_slots(planned_split(conversation.cache))} of a "
                                    f"{conversation.max_positions}-token context · ",
                                    ("/help for commands, /bye to leave", "dim")))
    if messages:
        fed = conversation.reconfigure(conversation.settings, messages)
        last = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        console.print(f"resumed conversation {log.id if log else conversation_id} · "
                      f"{sum(m['role'] == 'user' for m in messages)} turns · re-read {fed} tokens · last message: "
                      f"{last.strip().splitlines()[0][:60] if last.strip() else '(none)'}", style="dim", markup=False,
                      highlight=False)
    repl = Repl(conversation, console, read_line=lambda prompt: "", model_name=loaded.name, log=log)
    repl.use_reader(PromptReader(repl.toolbar, history_path()) if interactive else StreamReader(sys.stdin))
    code = repl.run()
    if repl.log is not None and repl.log.path.exists():
        err.print(f"conversation kept as {repl.log.id} (h2ochat run --conversation {repl.log.id})", style="dim",
                  markup=False, highlight=False)
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
