"""The package's shape, checked on the source: the core imports no engine, no class outgrows a
reader. (The layers and import cycles: tests/test_layers.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "ncgrpo"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_core_imports_no_engine() -> None:
    for path in (PKG / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        assert not names & {"transformers", "trl", "vllm", "accelerate", "verl"}, (path, names)


def test_no_class_over_500_lines() -> None:
    """A class a reader can hold in their head: the trainer's jobs are modules of ``ncgrpo.trainer``."""
    big = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 500:
                big.append(f"{_module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, big
