"""Greedy decoding, as the paper evaluates: the settings (:class:`DecodingSettings`, the engines of
``--engine``) and the transformers decoding step (one ``generate`` call per batch, each output scored by
the one rule-based scorer). What runs a whole evaluation into a folder: :mod:`ncgrpo.eval.evaluate`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ncgrpo.data.prompts import render_prompt
from ncgrpo.data.types import MATH_PROMPT, Question
from ncgrpo.models import tokenizer_of
from ncgrpo.rewards import GRADERS, Score, score

__all__ = [
    "ENGINES",
    "DecodingSettings",
    "engine_of",
    "eval_mode",
    "generate_greedy",
    "question_batches",
    "score_greedy",
]


@dataclass
class DecodingSettings:
    """Greedy decoding, as the paper evaluates (section 4.1).

    ``batch_size`` does not change greedy outputs (up to floating-point noise), so it is not part
    of a run's identity: a rerun with a smaller batch (after running out of memory) may append.
    """

    max_new_tokens: int = 2048
    batch_size: int = 8
    system_prompt: str | None = None
    math_prompt: str = MATH_PROMPT
    #: The answer grader (:data:`ncgrpo.rewards.GRADERS`); it changes outcomes, so it is part of the identity.
    grader: str = "ncgrpo"

    def __post_init__(self) -> None:
        if self.grader not in GRADERS:
            raise ValueError(f"grader must be one of {', '.join(GRADERS)}, got {self.grader!r}")
        for name in ("max_new_tokens", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["do_sample"] = False
        d["num_beams"] = 1
        return d

    def identity(self) -> dict[str, Any]:
        """The settings that change outputs (all but ``batch_size``)."""
        d = self.to_dict()
        d.pop("batch_size")
        return d


#: The decoding engines of ``ncgrpo eval --engine``.
ENGINES = ("transformers", "vllm")


def engine_of(model: Any) -> str:
    """The engine a model object decodes with: ``vllm`` for a
    :class:`~ncgrpo.eval.vllm_engine.VLLMEvalEngine`, else ``transformers``."""
    return getattr(model, "engine_name", "transformers")


@torch.no_grad()
def generate_greedy(
    model: Any, processor: Any, questions: Sequence[Question], settings: DecodingSettings
) -> list[str]:
    """Greedy completions for one batch of questions (left-padded, one ``generate`` call)."""
    texts = [
        render_prompt(processor, q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt)
        for q in questions
    ]
    tok = tokenizer_of(processor)
    has_images = any(q.images for q in questions)
    if has_images:
        if not hasattr(processor, "image_processor"):
            raise ValueError(
                f"{questions[0].uid}: questions have images but the model at hand is text-only "
                "(its processor has no image processor); evaluate a vision-language model"
            )
        images = [[im.convert("RGB") for im in q.images] for q in questions]
        if any(not ims for ims in images):
            raise ValueError("a batch mixes questions with and without images; batch them separately")
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    else:
        inputs = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    inputs = inputs.to(model.device)
    out = model.generate(
        **inputs,
        do_sample=False,
        num_beams=1,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    completions = out[:, inputs["input_ids"].shape[1] :]
    return tok.batch_decode(completions, skip_special_tokens=True)


def score_greedy(
    model: Any, processor: Any, questions: Sequence[Question], settings: DecodingSettings
) -> list[tuple[str, Score]]:
    """Greedy completions of one batch (:func:`generate_greedy`) and each one's :class:`Score` by
    ``settings.grader``: the one greedy-then-score step of ``ncgrpo eval``, the demo's validation and
    the embedded base's evaluation (training rewards call the same :func:`ncgrpo.rewards.score`)."""
    outputs = generate_greedy(model, processor, questions, settings)
    return [
        (text, score(text, q.answer, choices=q.choices, answer_type=q.answer_type, grader=settings.grader))
        for q, text in zip(questions, outputs, strict=True)
    ]


@contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode inside the block; its own mode (training or not) restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def question_batches(questions: list[Question], size: int) -> list[list[Question]]:
    """``questions`` in batches of at most ``size``: those with images first, then those without (the
    two cannot share a processor call), each kind in its input order."""
    with_img = [q for q in questions if q.images]
    without = [q for q in questions if not q.images]
    out: list[list[Question]] = []
    for group in (with_img, without):
        out.extend(group[i : i + size] for i in range(0, len(group), size))
    return out
