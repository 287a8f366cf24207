"""The package's layers, checked on the source: every import of ``src/ncgrpo``, at module level or
inside a function (``ast``, nothing imported), except those under ``if TYPE_CHECKING:`` (they never run).

Layers, lowest first. A module imports its own package and the layers below it; never a layer above
(upward) nor a peer of its own layer (sideways: peers are independent of each other):

0. ``core``                       the paper's math, pure tensor code
1. ``runs`` | ``data``            the run folder's files | benchmark loaders, prompts
2. ``processors`` | ``rewards``   torchvision-free Qwen VL processors | the one scorer
3. ``models``                     model and processor loading, ``tokenizer_of``
4. ``engines``                    adapters that apply the core inside an inference engine
5. ``methods``                    the rollout methods, registered by name (each says how it uses the engines)
6. ``rollout`` | ``trainer``      a method's groups without the trainer (``generate_groups``) |
                                  ``NCGRPOConfig`` / ``NCGRPOTrainer``, the TRL seam
7. ``eval`` | ``integrations``     evaluation, records, statistics, the probe | the verl worker
8. ``driver``                     what builds and runs a trainer, shared by ``ncgrpo train`` and the demo
9. ``toy``                        the embedded default (the library never imports it)
10. ``commands``                  the command line's commands
11. ``cli``                       the entry point (``ncgrpo``)
12. ``__main__``                  ``python -m ncgrpo``

The package root ``ncgrpo`` holds ``__version__`` and the lazy ``from ncgrpo import NCGRPOTrainer``
(its ``__getattr__``, the public facade): any module may import it, and its own lazy import of the
trainer is not a layer's import.

There is no import cycle between modules, nor between the layers' packages. A cycle or an upward
import hidden inside a function is still one: the test sees it. And an ncgrpo module imported inside a
function at all needs a measured reason, named in ``LAZY`` (``python tests/test_layers.py`` prints the
share of imports inside functions and any import that breaks the layers).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "ncgrpo"
ROOT = "ncgrpo"

LAYERS: list[tuple[str, ...]] = [
    ("core",),
    ("runs", "data"),
    ("processors", "rewards"),
    ("models",),
    ("engines",),
    ("methods",),
    ("rollout", "trainer"),
    ("eval", "integrations"),
    ("driver",),
    ("toy",),
    ("commands",),
    ("cli",),
    ("__main__",),
]
RANK = {pkg: i for i, peers in enumerate(LAYERS) for pkg in peers}

# An ncgrpo module imported inside a function is an edge a reader scanning the top of the file does not
# see; it stays inside a function only for a measured start-up reason, named here (module -> why).
LAZY: dict[str, str] = {
    "ncgrpo": "the public facade: `from ncgrpo import NCGRPOTrainer` loads TRL on first use",
    # `ncgrpo --help` imports every command module (0.37 s); each loads what its command runs when it
    # runs: torch (1.6 s), transformers (1.0 s), matplotlib (0.6 s), eval.report (0.13 s), data.benchmarks
    # (17 ms), eval.questions (14 ms)
    "ncgrpo.commands.compare": "eval.report when compare runs",
    "ncgrpo.commands.demo": "the toy demo (torch, transformers, TRL) when demo runs",
    "ncgrpo.commands.eval": "models, eval.evaluate, data.benchmarks, eval.questions when eval runs",
    "ncgrpo.commands.plot": "eval.plots (matplotlib) and eval.report when plot runs",
    "ncgrpo.commands.pretrain": "the toy base model (torch, transformers) when pretrain runs",
    "ncgrpo.commands.train": "the driver (torch, transformers, TRL) when train runs",
    "ncgrpo.commands.train_prepare": "models, methods, driver and the trainer when train runs",
    "ncgrpo.commands.probe": "models, methods (torch), trainer.config (TRL), data and rewards when probe runs",
    "ncgrpo.commands.train_settings": "trainer (TRL's config), data files and rewards when train runs",
    "ncgrpo.commands.train_smoke": "train_settings re-exports it (ncgrpo --help loads it without torch); the "
    "smoke overlay's model and data helpers (torch, transformers) load when --smoke runs",
    "ncgrpo.integrations.verl": "workers imports verl and ray (optional: the verl extra)",
    "ncgrpo.integrations.verl.main_ppo": "workers imports verl and ray (optional: the verl extra)",
    "ncgrpo.models": "processors imports transformers (+1.0 s) and registers the Qwen VL processors with "
    "AutoProcessor; ncgrpo.rollout and eval.probe import models for tokenizer_of without it",
}

@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported ncgrpo module
    line: int
    in_function: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk(node: ast.AST, in_function: bool = False):
    """Yield (import node, inside a function) for every import under ``node``, skipping the bodies
    of ``if TYPE_CHECKING:`` (its ``else:`` runs and is kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        elif _is_type_checking(child):
            for sub in child.orelse:
                yield from _walk(ast.Module(body=[sub], type_ignores=[]), in_function)
        else:
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(child, inner)


def _all_imports() -> tuple[list[Import], int, int]:
    """Every ncgrpo-to-ncgrpo import (resolved to the module it loads), and the count of all imports
    (any module) and of those inside functions."""
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    found: list[Import] = []
    total = inside = 0
    for name, path in sorted(files.items()):
        is_pkg = path.name == "__init__.py"
        for node, in_function in _walk(ast.parse(path.read_text(encoding="utf-8"))):
            total += 1
            inside += in_function
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against the importing module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([node.module] if node.module else []))
                # `from ncgrpo.core import noise` loads the submodule ncgrpo.core.noise
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if subs and len(subs) == len(node.names) else [base, *subs]
            for t in targets:
                if t in modules and t != name:
                    found.append(Import(name, t, node.lineno, in_function))
    return found, total, inside


def _package(module: str) -> str:
    """The layer's package of ``module``: ``ncgrpo.runs.folder`` -> ``runs``; the root -> ``ncgrpo``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer_breaks(imports: list[Import]) -> list[Import]:
    bad = []
    for imp in imports:
        a, b = _package(imp.src), _package(imp.dst)
        if a == ROOT or b == ROOT or a == b:
            continue
        if RANK[b] >= RANK[a]:
            bad.append(imp)
    return bad


def _describe(imp: Import) -> str:
    a, b = _package(imp.src), _package(imp.dst)
    kind = "upward" if RANK[b] > RANK[a] else "sideways"
    where = " (inside a function)" if imp.in_function else ""
    return f"{kind}: {imp.src} -> {imp.dst} ({_path(imp.src)}, line {imp.line}){where}"


def _path(module: str) -> str:
    rel = Path(*module.split("."))
    pkg = PKG.parent / rel / "__init__.py"
    return str((rel / "__init__.py") if pkg.is_file() else rel.with_suffix(".py"))


IMPORTS, TOTAL, INSIDE = _all_imports()


def test_every_package_has_a_layer() -> None:
    """A new top-level module or package is placed in LAYERS (none is left unchecked)."""
    missing = sorted({_package(m.src) for m in IMPORTS} - set(RANK) - {ROOT})
    missing += sorted(
        p.stem for p in PKG.iterdir() if p.suffix == ".py" and p.stem not in RANK and p.stem != "__init__"
    )
    missing += sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file() and p.name not in RANK)
    assert not missing, f"packages with no layer in LAYERS: {sorted(set(missing))}"


def test_no_upward_or_sideways_import() -> None:
    bad = _layer_breaks(IMPORTS)
    assert not bad, "imports that break the layers:\n" + "\n".join(_describe(i) for i in bad)


def test_ncgrpo_imports_inside_functions_only_for_a_named_reason() -> None:
    hidden = sorted({i.src for i in IMPORTS if i.in_function} - set(LAZY))
    lines = [
        f"{i.src} -> {i.dst} ({_path(i.src)}, line {i.line})"
        for i in IMPORTS
        if i.in_function and i.src in hidden
    ]
    assert not hidden, (
        "ncgrpo imports inside functions (hoist them to the top of the file, or name the measured reason "
        "in LAZY):\n" + "\n".join(lines)
    )


def test_the_lists_only_name_modules_that_need_them() -> None:
    lazy = {i.src for i in IMPORTS if i.in_function}
    stale = sorted(set(LAZY) - lazy)
    assert not stale, (
        f"LAZY names modules with no ncgrpo import inside a function (delete them): {stale}"
    )


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.src != ROOT:  # the root's lazy facade (see the module's docstring)
            graph.setdefault(imp.src, set()).add(imp.dst)
    lines = {(i.src, i.dst): i.line for i in IMPORTS}
    cycles = _cycles(graph)
    msg = []
    for comp in cycles:
        edges = [
            f"{a} -> {b} (line {lines[a, b]})" for a in comp for b in sorted(graph.get(a, ())) if b in comp
        ]
        msg.append("cycle: " + "; ".join(edges))
    assert not cycles, "\n".join(msg)


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for imp in IMPORTS:
        a, b = _package(imp.src), _package(imp.dst)
        if a != b and ROOT not in (a, b):
            graph.setdefault(a, set()).add(b)
    cycles = _cycles(graph)
    msg = []
    for comp in cycles:
        pairs = sorted(
            f"{i.src} -> {i.dst} (line {i.line})"
            for i in IMPORTS
            if _package(i.src) in comp and _package(i.dst) in comp and _package(i.src) != _package(i.dst)
        )
        msg.append(f"packages {comp} import each other: " + "; ".join(pairs))
    assert not cycles, "\n".join(msg)


def test_the_library_never_imports_the_toy_nor_the_command_line() -> None:
    """Said by the layers, stated on its own as the rule a reader looks for."""
    bad = [
        f"{i.src} -> {i.dst}"
        for i in IMPORTS
        if (_package(i.dst) == "toy" and _package(i.src) not in ("toy", "commands", "cli"))
        or (_package(i.dst) in ("commands", "cli") and _package(i.src) not in ("commands", "cli", "__main__"))
    ]
    assert not bad, bad


def test_the_checker_sees_what_it_must(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser itself: a function-level import, a relative import and a submodule import are seen;
    one under TYPE_CHECKING is not."""
    pkg = tmp_path / "ncgrpo"
    (pkg / "core").mkdir(parents=True)
    (pkg / "engines").mkdir()
    for p in (pkg, pkg / "core", pkg / "engines"):
        (p / "__init__.py").write_text("")
    (pkg / "engines" / "hook.py").write_text("")
    (pkg / "core" / "noise.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ncgrpo.engines import hook\n"
        "def f():\n    from ..engines import hook\n"
        "import ncgrpo.engines\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    found, total, inside = _all_imports()
    seen = {(i.src, i.dst, i.line, i.in_function) for i in found}
    assert seen == {
        ("ncgrpo.core.noise", "ncgrpo.engines.hook", 5, True),
        ("ncgrpo.core.noise", "ncgrpo.engines", 6, False),
    }
    assert (total, inside) == (3, 1)  # typing, the function's, ncgrpo.engines
    assert [_describe(i) for i in _layer_breaks(found)][0].startswith(
        "upward: ncgrpo.core.noise -> ncgrpo.engines"
    )


if __name__ == "__main__":  # python tests/test_layers.py: the share issue 45 counted (34%)
    print(f"imports inside functions: {INSIDE}/{TOTAL} = {INSIDE / TOTAL:.1%}")
    for imp in _layer_breaks(IMPORTS):
        print(_describe(imp))


#: the largest module in src/ncgrpo, in lines (issue 45: a module past it is split along its seams)
MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_the_bound():
    long = {
        str(p.relative_to(PKG)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along their seams): {long}"
