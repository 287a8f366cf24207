"""The package's layering, checked on the source (every import, module-level or inside a function).

Layers, lowest first; a module may import its own layer and the ones below, never above, with no
exception (every module of a package has the package's layer):

0. ``core``                                 the paper's math, pure tensor code
1. ``processors``, ``models``, ``data``,     model-independent inputs and model loading; the run
   ``runs``                                  folder's files
2. ``rewards``, ``engines``, ``methods``   the scorer; engine adapters around the core; the rollout
                                             methods (each says how it uses the engines)
3. ``eval``, ``trainer``, ``integrations``  the evaluation protocol and the probe; the TRL seam
4. ``driver``                               what builds and runs a trainer, shared by train and the demo
5. ``toy``                                  the embedded default (the library never imports it)
6. ``commands``, ``cli``                    the command line and its config parser (nothing imports it
                                             but ``cli``)

and there is no import cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "ncgrpo"

LAYERS = {
    "core": 0,
    "processors": 1,
    "models": 1,
    "data": 1,
    "runs": 1,
    "rewards": 2,
    "engines": 2,
    "methods": 2,
    "eval": 3,
    "trainer": 3,
    "integrations": 3,
    "driver": 4,
    "toy": 5,
    "commands": 6,
    "cli": 6,
    "__main__": 6,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        name = _module_name(path)
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("ncgrpo"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ncgrpo"):
                deps.add(node.module)
                # `from ncgrpo.core import noise` imports the submodule
                deps.update(f"{node.module}.{a.name}" for a in node.names)
    modules = set(graph)
    return {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}


def _layer(module: str) -> int | None:
    """The layer of ``module``: its top-level module or package's (``ncgrpo.runs.folder`` -> ``runs``)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def test_every_module_has_a_layer() -> None:
    """A new top-level module or package is placed in a layer above (none is left unchecked)."""
    missing = sorted(m for m in _imports() if "." in m and _layer(m) is None)
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_no_upward_import() -> None:
    bad = []
    for src, deps in _imports().items():
        ls = _layer(src)
        if ls is None:  # the package root re-exports the trainer lazily
            continue
        for dst in deps:
            ld = _layer(dst)
            if ld is not None and ld > ls:
                bad.append(f"{src} -> {dst}")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_nothing_imports_the_cli_and_the_library_never_imports_the_toy() -> None:
    bad = []
    for src, deps in _imports().items():
        top = src.split(".")[1] if "." in src else ""
        for dst in deps:
            if dst.startswith("ncgrpo.commands") and top not in ("commands", "cli"):
                bad.append(f"{src} -> {dst}")
            if dst.startswith("ncgrpo.toy") and top not in ("toy", "commands", "cli"):
                bad.append(f"{src} -> {dst}")
    assert not bad, "\n".join(sorted(bad))


def test_core_imports_no_engine() -> None:
    for path in (PKG / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not names & {"transformers", "trl", "vllm", "accelerate", "verl"}, (path, names)


def test_no_import_cycle() -> None:
    graph = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    # the package root imports the trainer lazily (from ncgrpo import NCGRPOTrainer); the trainer
    # imports `ncgrpo.core` etc., never the root, so the root is left out of the cycle check
    cycles = [c for c in cycles if c != ["ncgrpo", "ncgrpo.trainer"]]
    assert not cycles, f"import cycles: {cycles}"


def test_no_class_over_500_lines() -> None:
    """A class a reader can hold in their head: the trainer's jobs are modules of ``ncgrpo.trainer``."""
    big = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 500:
                big.append(f"{_module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big
