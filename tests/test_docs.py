"""docs/equations.md must point at code and tests that exist (so the map cannot drift)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "equations.md"


def _cells() -> list[str]:
    return [c for line in DOC.read_text().splitlines() if line.startswith("|") for c in line.split("|")]


def test_every_cited_test_exists() -> None:
    text = DOC.read_text()
    current_file: Path | None = None
    missing = []
    # cells cite `tests/x.py::name` and then continue with bare `name`s from the same file
    for cell in _cells():
        for token in re.findall(r"`([^`]+)`", cell):
            m = re.match(r"(tests/[\w/]+\.py)(?:::(\w+))?", token)
            if m:
                current_file = ROOT / m.group(1)
                if not current_file.exists():
                    missing.append(m.group(1))
                    continue
                name = m.group(2)
            elif re.fullmatch(r"test_\w+", token) and current_file is not None:
                name = token
            else:
                continue
            if name and not re.search(rf"^def {name}\b", current_file.read_text(), re.M):
                missing.append(f"{current_file.relative_to(ROOT)}::{name}")
    assert text and not missing, f"docs/equations.md cites tests that do not exist: {missing}"


def test_every_cited_function_exists() -> None:
    missing = []
    for cell in _cells():
        for token in re.findall(r"`(ncgrpo\.[\w.]+)", cell):
            parts = token.split(".")
            for cut in range(len(parts), 1, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    missing.append(token)
                break
            else:
                missing.append(token)
    assert not missing, f"docs/equations.md cites code that does not exist: {missing}"
