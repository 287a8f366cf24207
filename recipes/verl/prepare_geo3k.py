"""Write Geometry3K as verl 0.9.1's RL parquet files, with ncgrpo's prompt, for recipes/verl/.

    python recipes/verl/prepare_geo3k.py --out data/geo3k [--geo3k_path /data/geometry3k]

One file per split (train.parquet, validation.parquet, test.parquet) in the schema verl's
``RLHFDataset`` reads: ``prompt`` (one user message whose content is ncgrpo's prompt text: the problem
with its ``<image>`` placeholder, a space, NoisyRollout's format instruction; verl splits the content
at ``<image>``), ``images`` (PNG bytes), ``data_source`` ``hiyouga/geometry3k`` (verl's built-in
``geo3k`` score: ``0.9 * accuracy + 0.1 * format`` with mathruler's grader, NoisyRollout's reward),
``reward_model.ground_truth`` (the answer text) and ``extra_info`` with ``question_id``, which
ncgrpo's verl worker turns into the prompt's noise id exactly as ncgrpo's TRL trainer does for the same
question. ``--geo3k_path`` is ncgrpo's Geometry3K loader's (None: the ``datasets`` cache).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncgrpo.data.geometry3k import load_geometry3k
from ncgrpo.data.prompts import IMAGE_PLACEHOLDER, prompt_text
from ncgrpo.data.types import Question

DATA_SOURCE = "hiyouga/geometry3k"  # verl.utils.reward_score.default_compute_score -> geo3k.compute_score


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def verl_rows(questions: Sequence[Question], split: str) -> list[dict[str, Any]]:
    """verl's RL rows for ``questions`` (one per question, in order)."""
    rows = []
    for i, q in enumerate(questions):
        text = prompt_text(q)
        missing = len(q.images) - text.count(IMAGE_PLACEHOLDER)
        if missing < 0:
            raise ValueError(
                f"{q.uid}: {text.count(IMAGE_PLACEHOLDER)} <image> placeholders for {len(q.images)} images"
            )
        text = (
            IMAGE_PLACEHOLDER * missing + text
        )  # images first where the problem has none (ncgrpo's convention)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": text}],
                "images": [{"bytes": _png(im)} for im in q.images],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": q.answer},
                "extra_info": {"split": split, "index": i, "question_id": q.question_id, "answer": q.answer},
            }
        )
    return rows


def write(questions: Sequence[Question], split: str, out_dir: str | Path) -> Path:
    """``out_dir/split.parquet`` with :func:`verl_rows` of ``questions``."""
    import datasets

    path = Path(out_dir) / f"{split}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(verl_rows(questions, split)).to_parquet(str(path))
    return path


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for train/validation/test.parquet")
    ap.add_argument(
        "--geo3k_path", default=None, help="Geometry3K folder or parquet (default: the datasets cache)"
    )
    ap.add_argument("--splits", nargs="+", default=["train", "validation", "test"])
    args = ap.parse_args(argv)
    for split in args.splits:
        qs = load_geometry3k(args.geo3k_path, split)
        print(f"{split}: {len(qs)} questions -> {write(qs, split, args.out)}")


if __name__ == "__main__":
    main()
