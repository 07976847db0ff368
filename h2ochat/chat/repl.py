"""The interactive loop: read a line (prompt-toolkit), run a slash command or send it as a turn.

Reading is behind a small ``LineReader`` so the same loop serves a terminal (history, multiline,
a bottom toolbar with the cache state), piped standard input, and tests (prompt-toolkit pipe input).
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.text import Text

from .cache_view import cache_view, heavy_hitter_legend, heavy_hitter_text
from .status import STATUS_SEPARATOR, StatusLine, turn_summary
from .ui import ReplyPrinter
from ..kv import PositionLimitError
from .conversation import Conversation, ctrl_c_stops
from .settings import SETTINGS, check_recall
from ..errors import UserError, debugging, one_line
from .prompting import typed_text
from .history import ConversationLog, home, read_conversation, refuse_replacing, write_atomic
from ..loading.sources import ModelError
from ..policies import POLICIES, describe_policies
from .split import describe_slots, planned_split

# failures reported in one line (the user can fix them, or the machine ran out of something);
# anything else is a bug: its traceback is shown and the session goes on
ONE_LINE_ERRORS = (UserError, ModelError, OSError, PositionLimitError, MemoryError)

MULTILINE = '"""'
EXIT_COMMANDS = ("/bye", "/exit", "/quit")


SNAPSHOT_S = 2.0  # while a reply streams, the partial reply is written to the conversation file this often


def history_path() -> Path:
    """Where up-arrow history persists: in the h2ochat home (see history.home), beside the conversations."""
    return home() / "history"


class PromptReader:
    """Lines from a prompt-toolkit session: persistent history, Esc+Enter for a new line,
    a bottom toolbar with the cache state. ``input``/``output`` let tests drive it."""

    def __init__(self, toolbar: Callable[[], str] | None = None, history: Path | None = None, input=None, output=None):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()

        @bindings.add("escape", "enter")
        def _newline(event):  # Esc+Enter (Alt+Enter) inserts a line break instead of sending
            event.current_buffer.insert_text("\n")

        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True)
                store = FileHistory(str(history))
            except OSError:  # read-only home: history for this session only
                store = InMemoryHistory()
        else:
            store = InMemoryHistory()
        self.session = PromptSession(history=store, key_bindings=bindings, input=input, output=output,
                                     bottom_toolbar=toolbar, prompt_continuation="... ")

    def __call__(self, prompt: str) -> str:
        return self.session.prompt(prompt)


class StreamReader:
    """Lines from a file (piped standard input): no prompt, no editing."""

    def __init__(self, stream):
        self.stream = stream

    def __call__(self, prompt: str) -> str:
        line = self.stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")


HELP = [
    ("/help", "this list"),
    ("/clear", "new conversation, fresh cache"),
    ("/set NAME VALUE", ", ".join(SETTINGS) + " (a cache setting re-feeds the conversation)"),
    ("/set", "show the current settings"),
    ("/budget B", "KV slots per layer: 0.1 (share of the context) or 256 (slots); re-feeds the conversation"),
    ("/policy P", f"eviction policy ({', '.join(POLICIES)}); re-feeds the conversation"),
    ("/cache", "where the budget hurts: attention the evicted tokens held and heavy-hitter age per layer, "
               "what is still held of each turn, with --recall the cold tier (pages held, host bytes, recalls "
               "this turn, attention they drew) ('/cache layers': the per-layer table for a deep model)"),
    ("/hh", "the transcript with cached tokens highlighted (heavy hitters bold, evicted dimmed, "
            "recalled underlined)"),
    ("/stats", "totals for this session"),
    ("/save FILE", "write the conversation and settings as JSON (it is also kept by itself: `h2ochat history`); "
                   "an existing file is replaced only by '/save FILE --force' (or when this session saved it)"),
    ("/load FILE", "read a conversation saved with /save (re-feeds it); kept as a new conversation"),
    ("/bye, /exit, Ctrl-D", "leave"),
    ('"""', 'start a multi-line message; end it with """ (or press Esc then Enter for a new line)'),
]


class Repl:
    def __init__(self, conversation: Conversation, console: Console, read_line: Callable[[str], str],
                 model_name: str = "model", log: ConversationLog | None = None):
        self.conv, self.console, self.read_line = conversation, console, read_line
        self.model_name = model_name
        self.log = log  # where the conversation is kept after every turn (None: not kept)
        self.status = StatusLine.of_conversation(conversation)
        self.turns = 0
        self.saved_to: set[Path] = set()  # files this session's /save wrote: saving again replaces them
        self.leaving = False  # the input ended inside a """ block: answer what was typed, then leave
        self.totals = {"prompt_tokens": 0, "generated_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
        self.commands: dict[str, Callable[[str], None]] = {
            "/help": self.cmd_help, "/?": self.cmd_help, "/clear": self.cmd_clear, "/set": self.cmd_set,
            "/budget": self.cmd_budget, "/policy": self.cmd_policy, "/cache": self.cmd_cache, "/hh": self.cmd_hh,
            "/stats": self.cmd_stats, "/save": self.cmd_save, "/load": self.cmd_load,
        }

    def use_reader(self, read_line: Callable[[str], str]) -> None:
        """Where the lines come from (a prompt-toolkit session that shows this REPL's toolbar, or stdin)."""
        self.read_line = read_line

    # -- output helpers ---------------------------------------------------------------------------
    def say(self, message: str, style: str = "dim") -> None:
        self.console.print(Text(message, style=style))

    def toolbar(self) -> str:
        # prompt-toolkit draws this at every keystroke: the summary is read once per step (see status.StatusLine)
        head = f" {self.model_name} · {self.conv.settings.cache.policy} · "
        line = self.status(live=False, width=self.status_width(len(head)))
        if STATUS_SEPARATOR not in line and self.status_width() is not None:
            # too narrow for the evictions beside the slots: they matter more than the model's name and
            # the policy, which the user chose and knows
            return " " + self.status(live=False, width=self.status_width(1))
        return head + line

    def status_width(self, taken: int = 0) -> int | None:
        """The columns a status line may fill on this terminal, ``taken`` already used (None off a
        terminal: a pipe or a test gets every figure)."""
        return max(self.console.width - taken - 1, 1) if self.console.is_terminal else None

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Read and answer until the user leaves; returns the exit code."""
        ctrl_c_once = False
        while True:
            if self.leaving:
                return 0
            try:
                line = self.read_message()
            except EOFError:
                return 0
            except KeyboardInterrupt:
                if ctrl_c_once:
                    return 130
                self.say("(Ctrl-C again, Ctrl-D or /bye to leave)")
                ctrl_c_once = True
                continue
            ctrl_c_once = False
            if not line.strip():
                continue
            if line.strip().lower() in EXIT_COMMANDS:
                return 0
            self.handle(line)
            if self.conv.hangup:  # the terminal went away mid-reply: the turn is kept, leave
                return 128 + self.conv.hangup

    def read_message(self) -> str:
        line = self.read_line(">>> ")
        if not line.lstrip().startswith(MULTILINE):
            return line
        body = line.lstrip()[len(MULTILINE):]
        if body.rstrip().endswith(MULTILINE):
            return body.rstrip()[: -len(MULTILINE)]
        lines = [body] if body else []
        while True:
            try:
                more = self.read_line("... ")
            except EOFError:  # (Ctrl-D, or the end of piped input, inside the block)
                text = "\n".join(lines).strip("\n")
                if not text.strip():
                    raise
                # the lines typed are the user's: they are sent, not dropped; Ctrl-D still means leave
                self.say('(the input ended inside a """ block: sending what was typed, then leaving)', style="yellow")
                self.leaving = True
                return text
            if more.rstrip().endswith(MULTILINE):
                lines.append(more.rstrip()[: -len(MULTILINE)])
                return "\n".join(lines).strip("\n")
            lines.append(more)

    def handle(self, line: str) -> None:
        """One line: a slash command or a message. Failures are reported, never raised: a user
        error in one line, a bug with its traceback (every error with one under H2OCHAT_DEBUG=1)."""
        try:
            # (piped lines are decoded with surrogateescape: a stray byte would fail in the tokenizer)
            line = typed_text(line, "this line")
            if line.startswith("/") and not line.startswith("//"):
                name, _, argument = line.strip().partition(" ")
                command = self.commands.get(name.lower())
                if command is None:
                    self.say(f"unknown command {name}; /help lists the commands", style="yellow")
                    return
                try:
                    command(argument.strip())
                except KeyboardInterrupt:  # e.g. a long re-read: every command is all or nothing
                    self.say("(cancelled: the conversation is as it was)", style="yellow")
            else:
                self.reply(line[1:] if line.startswith("//") else line)
        except Exception as exc:
            if isinstance(exc, ONE_LINE_ERRORS) and not debugging():
                self.say(f"error: {one_line(exc)}", style="red")
                return
            self.console.print(Text("".join(traceback.format_exception(exc)).rstrip(), style="red"))
            self.say(f"error: {type(exc).__name__}: {one_line(exc)} (an h2ochat bug unless it says otherwise; "
                     "the conversation is as it was before this line)", style="red")

    def keep(self, partial: str | None = None) -> None:
        """Write the conversation to its file (with ``partial``, the reply so far, while it streams).
        A failure to write is said once and the session goes on."""
        if self.log is None:
            return
        data = self.conv.to_json()
        if partial is not None:
            data["messages"].append({"role": "assistant", "content": partial, "interrupted": True})
        try:
            notice = self.log.save(data)
        except OSError as exc:
            self.say(f"warning: cannot keep the conversation ({one_line(exc)}); /save FILE still works", style="yellow")
            self.log = None
            return
        if notice:
            self.say(f"note: {notice}", style="yellow")

    def reply(self, text: str) -> None:
        conv = self.conv
        partial: list[str] = []
        saved_at = time.monotonic()

        def show(piece: str) -> None:
            nonlocal saved_at
            printer.write(piece)
            partial.append(piece)
            if self.log is not None and time.monotonic() - saved_at >= SNAPSHOT_S:
                # a terminal that dies mid-reply loses at most the last couple of seconds
                self.keep(partial="".join(partial))
                saved_at = time.monotonic()

        self.status.begin_turn()  # the cold tier's figures for this turn count from here
        try:
            with ReplyPrinter(self.console, lambda: self.status(live=True, width=self.status_width())) as printer:
                with ctrl_c_stops(conv):  # (on_reading: a long prompt's reading, how far and the time left)
                    result = conv.send(text, on_piece=show, on_reading=printer.tick)
        finally:
            self.keep()  # the finished or interrupted turn; after a failed one, the state before it
        self.turns += 1
        for key in self.totals:
            self.totals[key] += getattr(result.timing, key)
        if result.interrupted and result.stopped_reading is None:
            self.say("[interrupted: the partial reply is kept]", style="yellow")
        elif result.interrupted:  # nothing was generated: there is no reply to keep
            self.say("[interrupted before the reply began: your message is kept, the reply is empty]",
                     style="yellow")
        for notice in result.notices:
            self.say(f"note: {notice}", style="yellow")
        self.say(turn_summary(result))

    # -- commands ---------------------------------------------------------------------------------
    def cmd_help(self, _: str) -> None:
        width = max(len(name) for name, _ in HELP)
        for name, text in HELP:
            self.console.print(Text.assemble((name.ljust(width + 2), "bold"), text))

    def cmd_clear(self, _: str) -> None:
        self.conv.clear()
        self.status.cache_replaced()
        if self.log is not None:
            self.log.start_new()  # the old conversation stays in the history
        self.say("new conversation, fresh cache")

    def cmd_set(self, argument: str) -> None:
        if not argument:
            for key, value in self.conv.settings.listing():
                self.console.print(Text.assemble((f"{key:20}", "bold"), repr(value) if isinstance(value, str) else str(value)))
            return
        name, _, value = argument.partition(" ")
        if not value.strip() and name.lower() not in ("system", "seed"):
            raise UserError(f"usage: /set {name} VALUE")
        self.change(name, value or "")

    def change(self, name: str, value: str) -> None:
        """One setting from text: a cache setting re-feeds the conversation into a new cache. Nothing
        changes unless all of it works (the chat stays as it was on a bad value)."""
        conv = self.conv
        settings, canonical = conv.settings.with_value(name, value)
        check_recall(settings.cache)  # /set page 0 while recall is off would only fail at a later /set recall
        shown = settings.get(canonical)
        if SETTINGS[canonical].on_cache:
            tokens = conv.reconfigure(settings)
            self.status.cache_replaced()
            self.say(f"{canonical} {shown}: new cache of {describe_slots(planned_split(conv.cache))}"
                     + (f"; re-fed the conversation ({tokens} tokens)" if tokens else ""))
        else:
            conv.use_settings(settings)
            self.say(f"{canonical} = {shown!r}")
            if canonical == "system" and conv.messages:
                self.say("the conversation will be read again with it at the next turn")
        self.keep()

    def cmd_budget(self, argument: str) -> None:
        if not argument:
            self.say(f"budget {self.conv.settings.cache.budget}: "
                     f"{describe_slots(planned_split(self.conv.cache), ' per layer and KV head')}")
            return
        self.change("budget", argument)

    def cmd_policy(self, argument: str) -> None:
        if not argument:
            width = max(len(name) for name, _ in describe_policies())
            lines = [f"  {name:<{width}}  {summary}" for name, summary in describe_policies()]
            self.say(f"policy {self.conv.settings.cache.policy}; the policies (knobs may follow: "
                     "/policy mean:sinks=8):\n" + "\n".join(lines))
            return
        self.change("policy", argument)

    def cmd_cache(self, argument: str) -> None:
        self.console.print(cache_view(self.conv.cache, self.conv.parts(), all_layers=argument == "layers",
                                         width=self.console.width, summary=self.status.summary()))

    def cmd_hh(self, _: str) -> None:
        conv = self.conv
        ids = conv.ids + conv.pending
        if not ids:
            self.say("nothing in the cache yet")
            return
        self.console.print(heavy_hitter_text(conv.tokenizer, ids, conv.cache))
        self.console.print(heavy_hitter_legend(conv.cache, len(ids)))

    def cmd_stats(self, _: str) -> None:
        t = self.totals
        prefill = t["prompt_tokens"] / t["prefill_s"] if t["prefill_s"] else 0.0
        decode = t["generated_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        self.say(f"{self.turns} turns · {t['prompt_tokens']} prompt tokens ({prefill:.0f} tok/s) · "
                 f"{t['generated_tokens']} generated ({decode:.1f} tok/s)", style="")
        self.say(self.status(live=False), style="")

    def cmd_save(self, argument: str) -> None:
        force = argument.endswith(" --force") or argument == "--force"
        argument = argument.removesuffix("--force").strip() if force else argument
        if not argument:
            raise UserError("usage: /save FILE [--force]")
        path = Path(argument).expanduser()
        if not force and path.resolve() not in self.saved_to:
            refuse_replacing(path, f"'/save {argument} --force' replaces it, or give another name")
        write_atomic(path, self.conv.to_json())
        self.saved_to.add(path.resolve())
        self.say(f"saved {len(self.conv.messages)} messages and the settings to {path}")

    def cmd_load(self, argument: str) -> None:
        if not argument:
            raise UserError("usage: /load FILE")
        path = Path(argument).expanduser()
        tokens = self.conv.load_json(read_conversation(path))
        self.status.cache_replaced()
        if self.log is not None:
            self.log.start_new()  # the conversation before /load stays as it was
        self.keep()
        self.say(f"loaded {len(self.conv.messages)} messages from {path}; re-fed {tokens} tokens")
