"""Write the held-out filler texts of the recall pass key (issue 34): texts of four kinds found on this
machine, none of them the development texts (Tiny Shakespeare, the GFDL) the recall defaults were tuned
on. They are made, not copied into the repository: each run writes them anew and prints their names,
sources, sizes and sha256 (the JSON of a measurement records the sha256 of the files it read).

    python benchmarks/heldout_texts.py /tmp/heldout

- ``gpl3.txt``: a licence (legal prose), /usr/share/common-licenses/GPL-3;
- ``bash_man.txt``: a manual page (technical reference), ``man bash`` at 80 columns, overstrikes removed;
- ``python_docstrings.txt``: API documentation, the docstrings of the public names of some standard
  library modules (argparse, collections, functools, json, pathlib, subprocess, textwrap), in order;
- ``idle_news.txt``: a changelog (release notes), the standard library's idlelib/NEWS2x.txt.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

MODULES = ("argparse", "collections", "functools", "json", "pathlib", "subprocess", "textwrap")


def docstrings() -> str:
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", None) or [a for a in dir(module) if not a.startswith("_")]):
            doc = inspect.getdoc(getattr(module, attr, None))
            if doc and not isinstance(getattr(module, attr), (str, int, float, bytes)):
                parts.append(f"{name}.{attr}: {doc}")
    return "\n\n".join(parts)


def man_page(name: str) -> str:
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": ""}
    rendered = subprocess.run(["man", name], env=env, capture_output=True, text=True, check=True).stdout
    return subprocess.run(["col", "-b"], input=rendered, capture_output=True, text=True, check=True).stdout


def texts() -> dict[str, tuple[str, str]]:
    import idlelib

    news = Path(idlelib.__file__).parent / "NEWS2x.txt"
    return {"gpl3.txt": ("/usr/share/common-licenses/GPL-3", Path("/usr/share/common-licenses/GPL-3").read_text()),
            "bash_man.txt": ("man bash | col -b (MANWIDTH=80)", man_page("bash")),
            "python_docstrings.txt": (f"docstrings of {', '.join(MODULES)} (Python {sys.version.split()[0]})",
                                      docstrings()),
            "idle_news.txt": (str(news), news.read_text())}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/heldout")
    out.mkdir(parents=True, exist_ok=True)
    listing = []
    for name, (source, text) in texts().items():
        (out / name).write_text(text)
        listing.append({"file": name, "source": source, "chars": len(text),
                        "sha256": hashlib.sha256(text.encode()).hexdigest()})
    print(json.dumps(listing, indent=1))


if __name__ == "__main__":
    main()
