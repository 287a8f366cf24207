"""The one question type every loader returns (real benchmarks and the synthetic suite alike)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: Option letters, by position: option i is LETTERS[i] (benchmarks, the scorer, the synthetic suite).
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

Role = Literal["in_domain", "ood", "general"]
AnswerType = Literal["choice", "yesno", "number", "free"]

#: NoisyRollout's math prompt (anchors.md), appended to every question.
MATH_PROMPT = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE "
    "put in \\boxed{}."
)


@dataclass
class Question:
    """One benchmark question, already in the paper's prompt convention.

    ``problem`` is the question text as the model sees it (without the math prompt); an ``<image>``
    placeholder marks where each image goes (Geometry3K convention), and questions without one get
    their images before the text. ``answer`` is the gold answer the shared scorer compares against
    (``ncgrpo.rewards``); ``choices`` is the option list for multiple-choice questions, in order,
    so a gold letter ``B`` and the text of option 2 grade the same.
    """

    benchmark: str  # e.g. "geo3k", "mathvista", "synthetic/angles"
    question_id: str  # unique within its benchmark
    problem: str
    answer: str
    images: list[Any] = field(default_factory=list)  # PIL.Image.Image
    choices: list[str] | None = None
    answer_type: AnswerType = "free"
    role: Role = "ood"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def uid(self) -> str:
        """Identifier unique across benchmarks: ``benchmark/question_id``."""
        return f"{self.benchmark}/{self.question_id}"
