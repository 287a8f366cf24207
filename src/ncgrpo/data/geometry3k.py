"""Geometry3K, the paper's training set (``hiyouga/geometry3k`` schema), and its TRL dataset form.

Rows hold ``images`` (a list with one diagram), ``problem`` (``"<image>Find x."``), ``answer`` (the
text of the right choice, e.g. ``"3"``), plus ``id``, ``choices`` and ``ground_truth`` (the letter).
NoisyRollout trains and scores this free-form: the problem shows no options and the reward grades the
``\\boxed{}`` content against ``answer``; we keep that, and put ``choices``/``ground_truth`` in
metadata.

The synthetic suite exports the same schema with extra columns ``family``, ``role`` and
``answer_type``; rows with a ``family`` become benchmark ``"synthetic/<family>"``, so one loader
serves real and synthetic data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from ncgrpo.data.prompts import build_messages
from ncgrpo.data.types import MATH_PROMPT, AnswerType, Question, Role

if TYPE_CHECKING:
    import datasets

    from ncgrpo.data.benchmarks import RowContext

__all__ = ["convert_geo3k_rows", "load_geometry3k", "to_trl_dataset", "trl_features"]

_ROLES = set(get_args(Role))
_ANSWER_TYPES = set(get_args(AnswerType))


def load_geometry3k(
    path: str | Path | None, split: str = "train", *, limit: int | None = None
) -> list[Question]:
    """Geometry3K ``split`` (train/validation/test) from ``path`` (hub layout or one parquet file).

    ``path=None`` reads ``hiyouga/geometry3k`` from the ``datasets`` cache.
    """
    from ncgrpo.data.benchmarks import load_benchmark

    return load_benchmark("geo3k", path, split=split, limit=limit)


def convert_geo3k_rows(rows: Iterable[tuple[int, dict[str, Any]]], ctx: RowContext) -> list[Question]:
    """Rows in the geo3k schema (real or synthetic) to questions; errors name row and field."""
    from ncgrpo.data.benchmarks import IMAGE_PLACEHOLDER, LETTERS, gold_letter, infer_answer_type

    out = []
    for i, row in rows:
        images = ctx.images(row, i, "images")
        if not images:
            raise ctx.error(i, "field 'images' is empty")
        problem = ctx.text(row, i, "problem")
        answer = ctx.text(row, i, "answer")
        n_marks = problem.count(IMAGE_PLACEHOLDER)
        if n_marks and n_marks != len(images):
            raise ctx.error(
                i,
                f"field 'problem' has {n_marks} '<image>' placeholders but field 'images' has {len(images)}",
            )

        family = ctx.optional(row, "family")
        benchmark = f"synthetic/{family}" if family else ctx.benchmark
        role = ctx.optional(row, "role", "in_domain")
        if role not in _ROLES:
            raise ctx.error(i, f"field 'role' should be one of {sorted(_ROLES)}, got {role!r}")
        hub_choices = [str(c) for c in (ctx.optional(row, "choices") or [])]
        ground_truth = ctx.optional(row, "ground_truth")

        answer_type = ctx.optional(row, "answer_type") or infer_answer_type(answer)
        if answer_type not in _ANSWER_TYPES:
            raise ctx.error(
                i, f"field 'answer_type' should be one of {sorted(_ANSWER_TYPES)}, got {answer_type!r}"
            )
        choices = None
        if answer_type == "choice":
            if not hub_choices:
                raise ctx.error(i, "field 'choices' is empty but answer_type is 'choice'")
            choices = hub_choices
            gt = str(ground_truth or "").strip().upper()
            answer = (
                gt
                if len(gt) == 1 and gt in LETTERS[: len(choices)]
                else gold_letter(answer, choices, ctx, i, by="text")
            )
        elif answer_type == "yesno":
            answer = answer.lower()
            if answer not in {"yes", "no"}:
                raise ctx.error(
                    i, f"field 'answer' should be 'yes' or 'no' for answer_type 'yesno', got {answer!r}"
                )

        qid = ctx.optional(row, "question_id", ctx.optional(row, "id"))
        out.append(
            Question(
                benchmark=str(benchmark),
                question_id=str(qid) if qid is not None else str(i),
                problem=problem,
                answer=answer,
                images=images,
                choices=choices,
                answer_type=answer_type,
                role=role,
                metadata={
                    "split": ctx.split,
                    "choices": hub_choices or None,
                    "ground_truth": ground_truth,
                    **({"family": family} if family else {}),
                },
            )
        )
    return out


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
