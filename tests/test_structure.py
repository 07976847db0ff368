"""The shape of the code a newcomer follows: no import cycles between h2ochat's modules (imports
inside functions included: a lazy import hides a cycle, it does not remove it), no module writing
another object's private fields, and the eviction route chosen once per layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import h2ochat

PACKAGE = Path(h2ochat.__file__).parent


def module_name(path: Path) -> str:
    parts = ("h2ochat", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The h2ochat modules ``path`` imports anywhere in its body."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base) if node.level else node.module or ""
            for alias in node.names:  # `from . import cache` names a module, `from .cache import X` does not
                candidate = f"{target}.{alias.name}"
                found.add(candidate if (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists()
                          else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module.startswith("h2ochat.") and module != name}


def test_no_import_cycles_between_modules():
    graph = {module_name(path): imports(path) for path in PACKAGE.rglob("*.py")}
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            assert state.get(target) != "open", "import cycle: " + " -> ".join(trail[trail.index(target):] + [target]) \
                if target in trail else f"import cycle through {target}"
            if target not in state:
                visit(target, trail + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_module_writes_another_objects_private_fields():
    """``x._field = ...`` on anything but ``self``/``cls`` reaches into another object's state, unless
    the module writing it is the one whose class owns that field (assigns ``self._field``)."""
    write = re.compile(r"\b(?!self\b|cls\b)([A-Za-z_][\w.\[\]]*)\.(_[A-Za-z]\w*)\s*(=|\+=|-=)(?!=)")
    owned = re.compile(r"\bself\.(_[A-Za-z]\w*)\s*(?::[^=]+)?=(?!=)")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text(encoding="utf-8").splitlines()
        own_fields = {match.group(1) for line in lines for match in owned.finditer(line)}
        for number, line in enumerate(lines, 1):
            for match in write.finditer(line.split("#")[0]):
                if match.group(2) not in own_fields:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_the_eviction_route_is_chosen_once_per_layer(monkeypatch):
    """The kernel backend (H2OCHAT_KERNELS, the device) is looked up when a layer allocates its slots,
    not on every attention or eviction: decoding asks the kernels' dispatch nothing more (the layer
    keeps its ``Backend``)."""
    from h2ochat_kernels import dispatch

    from h2ochat.kv import H2OCache

    asked = []
    original = dispatch.kernel_backend
    monkeypatch.setattr(dispatch, "kernel_backend", lambda device: asked.append(device) or original(device))
    cache = H2OCache(2, "h2o", 4, max_positions=100)
    for _ in range(10):  # 4 fill the slots, 6 evict
        cache.position_ids(1, 1)
        for layer in range(2):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), layer)
            pending = cache.layers[layer]
            pending.attend(torch.randn(1, 2, 1, 8), pending.pending_key, pending.pending_value, None, 0.3)
    assert cache.evicted_tokens() == 2 * 2 * 6
    assert len(asked) == 2  # once per layer, at allocation
