"""Reward functions refuse mismatched column lengths (issue 10, class 3).

TRL calls a reward function with one entry per completion in every column. Before, ``math_reward``
with 3 completions and 1 answer returned 3 rewards (rows 1 and 2 silently scored 0 against a
missing answer) instead of saying the batch is misaligned.
"""

from __future__ import annotations

import pytest

from ncgrpo import rewards

COMPLETIONS = ["<think>x</think> \\boxed{2}", "<think>x</think> \\boxed{3}", "\\boxed{2}"]


@pytest.mark.parametrize("fn", ["math_reward", "accuracy_reward"])
def test_answer_column_shorter_than_completions_is_an_error(fn: str) -> None:
    with pytest.raises(ValueError, match="3 completions"):
        getattr(rewards, fn)(COMPLETIONS, answer=["2"])


@pytest.mark.parametrize("fn", ["math_reward", "accuracy_reward"])
def test_optional_column_of_the_wrong_length_is_an_error(fn: str) -> None:
    with pytest.raises(ValueError, match="3 completions"):
        getattr(rewards, fn)(COMPLETIONS, answer=["2", "3", "2"], answer_type=["free"])


def test_aligned_columns_still_score() -> None:
    assert rewards.accuracy_reward(COMPLETIONS, answer=["2", "3", "4"]) == [1.0, 1.0, 0.0]
