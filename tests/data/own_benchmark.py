"""A benchmark of one's own as a user writes it (issue 32, item 7): used by tests/data and tests/eval."""

from __future__ import annotations

import json
from pathlib import Path


def write_own_benchmark(folder: Path, name: str = "my.jsonl") -> Path:
    """A user's benchmark as JSON lines: two rows with a figure (a relative path), two text-only rows."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for k in range(2):
        Image.fromarray(np.full((12, 12, 3), 60 * k, dtype=np.uint8)).save(folder / f"fig{k}.png")
    rows = [
        {"id": "f0", "problem": "<image>How many sides?", "answer": "4", "images": ["fig0.png"]},
        {"id": "f1", "question": "What colour is it?", "answer": "grey", "image": "fig1.png"},
        {"id": "t0", "problem": "What is 2 + 3?", "answer": "5"},
        {"id": "t1", "problem": "Is 7 prime?", "answer": "Yes"},
    ]
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
