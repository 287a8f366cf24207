"""``ncgrpo eval`` on the built-in text benchmarks and on a TRL-style ``prompt`` file (issue 44).

Before: ``--benchmarks gsm8k --data gsm8k=test.jsonl`` ran as a benchmark of one's own and took
GSM8K's whole worked solution as the gold, so every answer scored wrong; ``--data mine=FILE`` needed a
``problem`` or ``question`` column, where TRL's datasets hold ``prompt``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ncgrpo import cli
from ncgrpo.eval.records import read_records

GSM8K_ROWS = [  # the layout of openai/grade-school-math's test.jsonl
    {
        "question": "Janet has 16 eggs and eats 3. How many are left?",
        "answer": "16 - 3 = <<16-3=13>>13\n#### 13",
    },
    {
        "question": "A house costs $80,000 and repairs $50,000. Total?",
        "answer": "<<80000+50000=130000>>\n#### 130,000",
    },
]
PROMPT_ROWS = [  # TRL's layouts: a string prompt, and conversational ones
    {"prompt": "What is 2 + 3?", "answer": "5"},
    {"prompt": [{"role": "user", "content": "What is 4 + 4?"}], "answer": "8"},
    {"prompt": [{"role": "user", "content": [{"type": "text", "text": "What is 1 + 1?"}]}], "answer": "2"},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_eval_gsm8k_golds_and_a_prompt_column(tmp_path, monkeypatch):
    from tiny_models import save_tiny_vl

    monkeypatch.chdir(tmp_path)
    base = save_tiny_vl(tmp_path / "base")
    gsm8k = _jsonl(tmp_path / "test.jsonl", GSM8K_ROWS)
    mine = _jsonl(tmp_path / "mine.jsonl", PROMPT_ROWS)
    argv = [
        "eval",
        "--model_name_or_path",
        str(base),
        "--max_new_tokens",
        "2",
        "--device",
        "cpu",
        "--no_progress",
    ]
    argv += [
        "--benchmarks",
        "gsm8k",
        "mine",
        "--data",
        f"gsm8k={gsm8k}",
        f"mine={mine}",
        "--output_dir",
        "out",
    ]
    assert cli.main(argv) == 0
    records = read_records(tmp_path / "out" / "records.jsonl")
    got = {(r.benchmark, r.question_id): (r.gold, r.role) for r in records}
    assert got == {
        ("gsm8k", "0"): ("13", "ood"),
        ("gsm8k", "1"): ("130000", "ood"),  # the number after '#### ', commas removed
        ("mine", "0"): ("5", "in_domain"),
        ("mine", "1"): ("8", "in_domain"),
        ("mine", "2"): ("2", "in_domain"),
    }
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["split"]["gsm8k"] == "test"
