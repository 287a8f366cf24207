"""TRL reward functions built on :func:`ncgrpo.rewards.score`: ``accuracy_reward``, ``format_reward`` and
NoisyRollout's shaped ``math_reward``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from ncgrpo.rewards.grading import _check_grader, _mathruler, format_ok, score

#: NoisyRollout's reward weights (anchors.md): ``0.9 * accuracy + 0.1 * format``.
FORMAT_WEIGHT = 0.1
ACCURACY_WEIGHT = 1.0 - FORMAT_WEIGHT  # 0.9


# ---------------------------------------------------------------------------------------------
# TRL reward functions: f(prompts, completions, completion_ids=None, **dataset_columns) -> list


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or conversational ``[{"role": "assistant", "content": ...}]``
    where content is a string or a list of typed parts (``{"type": "text", "text": ...}``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        return "\n".join(
            _content_text(m.get("content"))
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        )
    return "" if completion is None else str(completion)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # typed parts; image parts carry no text
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                texts.append(str(part.get("text") or ""))
        return "".join(texts)
    return str(content)


def _row(column: Sequence[Any] | None, i: int) -> Any:
    try:
        return None if column is None else column[i]
    except Exception:
        return None


def _row_choices(column: Sequence[Any] | None, i: int) -> list[str] | None:
    value = _row(column, i)
    if value is None or isinstance(value, (str, bytes, dict)):
        return None
    try:
        return [str(c) for c in value] or None  # a list, tuple or array of options
    except TypeError:
        return None


def _accuracies(completions, answer, choices, answer_type, grader: str = "ncgrpo") -> list[float]:
    for name, col in (("answer", answer), ("choices", choices), ("answer_type", answer_type)):
        if col is not None and not isinstance(col, str) and len(col) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(col)} entries in column {name!r}")
    out = []
    for i, completion in enumerate(completions):
        gold = _row(answer, i)
        kind = _row(answer_type, i) or "free"
        try:
            text = completion_text(completion)
        except Exception:
            text = ""
        correct = (
            gold is not None
            and score(text, gold, choices=_row_choices(choices, i), answer_type=kind, grader=grader).correct
        )
        out.append(1.0 if correct else 0.0)
    return out


def accuracy_reward(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
    """1.0 where the last boxed answer grades equal to ``answer`` (Algorithm 1 line 9), else 0.0."""
    return _accuracies(completions, answer, choices, answer_type)


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 where the completion matches :data:`FORMAT_PATTERN` (``<think>..</think>..\\boxed{..}``)."""
    out = []
    for completion in completions:
        try:
            out.append(1.0 if format_ok(completion_text(completion)) else 0.0)
        except Exception:
            out.append(0.0)
    return out


def make_math_reward(
    format_weight: float = FORMAT_WEIGHT, grader: str = "ncgrpo"
) -> Callable[..., list[float]]:
    """NoisyRollout's shaped reward ``(1 - w) * accuracy + w * format`` as a TRL reward function.

    ``grader="mathruler"`` grades accuracy exactly as NoisyRollout does (``mathruler``'s
    ``grade_answer`` on ``extract_boxed_content``); the default is ncgrpo's rules
    (:func:`~ncgrpo.rewards.grade`). TRL logs reward functions by ``__name__``: ``math_reward`` for the
    defaults, ``math_reward_fmt{w}`` for another weight, with ``_mathruler`` appended for that grader.
    """
    w = float(format_weight)
    if not 0.0 <= w <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight!r}")
    _check_grader(grader)
    if grader == "mathruler":
        _mathruler()

    def reward(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
        acc = _accuracies(completions, answer, choices, answer_type, grader)
        fmt = format_reward(completions)
        return [(1.0 - w) * a + w * f for a, f in zip(acc, fmt, strict=True)]

    name = "math_reward" if w == FORMAT_WEIGHT else f"math_reward_fmt{w:g}"
    name += "" if grader == "ncgrpo" else f"_{grader}"
    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = f"{1.0 - w:g} * accuracy + {w:g} * format (NoisyRollout's reward)."
    return reward


#: ``ACCURACY_WEIGHT * accuracy + FORMAT_WEIGHT * format``; the GRPO recipes' reward.
math_reward = make_math_reward(FORMAT_WEIGHT)


@lru_cache(maxsize=1)
def _math_reward_mathruler() -> Callable[..., list[float]]:
    return make_math_reward(FORMAT_WEIGHT, grader="mathruler")


def math_reward_mathruler(completions, answer, choices=None, answer_type=None, **kwargs) -> list[float]:
    """:data:`math_reward` graded exactly as NoisyRollout grades (the ``mathruler`` package, extra
    ``noisyrollout``). Built on first call, so importing this module never needs mathruler."""
    return _math_reward_mathruler()(completions, answer, choices, answer_type, **kwargs)
