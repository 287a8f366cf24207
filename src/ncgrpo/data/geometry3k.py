"""Geometry3K, the paper's training set (``hiyouga/geometry3k`` schema), and its TRL dataset form.

Rows hold ``images`` (a list with one diagram), ``problem`` (``"<image>Find x."``), ``answer`` (the
text of the right choice, e.g. ``"3"``), plus ``id``, ``choices`` and ``ground_truth`` (the letter).
NoisyRollout trains and scores this free-form: the problem shows no options and the reward grades the
``\\boxed{}`` content against ``answer``; we keep that, and put ``choices``/``ground_truth`` in
metadata.

The synthetic suite exports the same schema with extra columns ``family``, ``role`` and
``answer_type``; rows with a ``family`` become benchmark ``"synthetic/<family>"``, so one loader
serves real and synthetic data (the row converter is ``ncgrpo.data.benchmarks``' geo3k entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ncgrpo.data.benchmarks import load_benchmark
from ncgrpo.data.prompts import build_messages
from ncgrpo.data.types import MATH_PROMPT, Question

if TYPE_CHECKING:
    import datasets

__all__ = ["load_geometry3k", "to_trl_dataset", "trl_features"]


def load_geometry3k(
    path: str | Path | None, split: str = "train", *, limit: int | None = None
) -> list[Question]:
    """Geometry3K ``split`` (train/validation/test) from ``path`` (hub layout or one parquet file).

    ``path=None`` reads ``hiyouga/geometry3k`` from the ``datasets`` cache.
    """
    return load_benchmark("geo3k", path, split=split, limit=limit)


def trl_features() -> datasets.Features:
    """Column types of :func:`to_trl_dataset` (message content is always a list of typed parts)."""
    import datasets

    part = {"type": datasets.Value("string"), "text": datasets.Value("string")}
    return datasets.Features(
        {
            "prompt": datasets.List({"role": datasets.Value("string"), "content": datasets.List(part)}),
            "images": datasets.List(datasets.Image()),
            "answer": datasets.Value("string"),
            "choices": datasets.List(datasets.Value("string")),
            "answer_type": datasets.Value("string"),
            "question_id": datasets.Value("string"),
            "benchmark": datasets.Value("string"),
            "role": datasets.Value("string"),
        }
    )


def to_trl_dataset(
    questions: Sequence[Question],
    *,
    system_prompt: str | None = None,
    math_prompt: str = MATH_PROMPT,
) -> datasets.Dataset:
    """A ``datasets.Dataset`` in the form TRL 1.16's ``GRPOTrainer`` takes for VLM training.

    ``prompt`` is a conversational prompt whose user content has one ``{"type": "image"}`` part per
    image (no payload) and ``images`` the matching PIL images: the trainer fills the placeholders from
    the ``images`` column (``prepare_multimodal_messages``), so their counts must agree. The other
    columns reach reward functions as keyword arguments (``answer``, ``choices``, ``answer_type``, ...).
    Arrow stores an image part as ``{"type": "image", "text": None}``, which the trainer still treats
    as an unfilled placeholder.
    """
    import datasets

    rows = []
    for q in questions:
        rows.append(
            {
                "prompt": build_messages(q, system_prompt=system_prompt, math_prompt=math_prompt),
                "images": list(q.images),
                "answer": q.answer,
                "choices": list(q.choices or []),
                "answer_type": q.answer_type,
                "question_id": q.question_id,
                "benchmark": q.benchmark,
                "role": q.role,
            }
        )
    return datasets.Dataset.from_list(rows, features=trl_features())
