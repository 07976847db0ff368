"""Story openings and chat system prompts shipped with h2ochat, usable by bare name.

Files are ``story-*.txt`` (openings for `h2ochat story`) and ``system-*.txt`` (system prompts for
`h2ochat run --system NAME`). ``find("lighthouse")`` finds ``story-lighthouse.txt``.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
KINDS = ("story", "system")


def names(kind: str | None = None) -> list[str]:
    """Bare names of the shipped prompts (of one kind, or all), sorted."""
    found = []
    for path in sorted(FOLDER.glob("*.txt")):
        prefix, _, rest = path.stem.partition("-")
        if prefix in KINDS and (kind is None or prefix == kind):
            found.append(rest)
    return found


def find(name: str, kind: str | None = None) -> Path | None:
    """The shipped file for ``name``: an exact file name, NAME.txt, or KIND-NAME.txt."""
    stem = name[:-4] if name.endswith(".txt") else name
    kinds = [kind] if kind else list(KINDS)
    for candidate in [stem, *(f"{k}-{stem}" for k in kinds)]:
        path = FOLDER / f"{candidate}.txt"
        if path.is_file():
            return path
    return None


def read(name_or_path: str | Path, kind: str | None = None) -> str:
    """Text of a prompt file given as a path, or as the bare name of a shipped prompt."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        shipped = find(str(name_or_path), kind)
        if shipped is None:
            available = ", ".join(names(kind)) or "none"
            raise FileNotFoundError(2, f"no such prompt file (shipped {kind or ''} prompts: {available})".replace("  ", " "),
                                    str(name_or_path))
        path = shipped
    return path.read_text(encoding="utf-8").strip()


def system_prompt(text: str) -> str:
    """A --system value: the name of a shipped system prompt, else the text itself."""
    shipped = find(text, "system") if "\n" not in text and len(text) < 64 else None
    return shipped.read_text(encoding="utf-8").strip() if shipped else text
