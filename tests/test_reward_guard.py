"""Issue 26, item 10: a library reward function returning inf, NaN, None, a string, a scalar or the
wrong number of rewards is an error naming the function and the step (``ncgrpo.trainer.reward_guard``),
applied once in ``NCGRPOTrainer.__init__``. ``None`` for one completion stays TRL's "does not apply"."""

from __future__ import annotations

import asyncio
import decimal
import fractions
import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ncgrpo.trainer.reward_guard import (
    AsyncRewardGuard,
    RewardFunctionError,
    RewardGuard,
    check_rewards,
    guard_reward_funcs,
)

STATE = SimpleNamespace(global_step=7)
COMPLETIONS = ["a", "b", "c"]


def returning(value):
    def my_reward(completions, **kwargs):
        return value

    return my_reward


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1.0, math.inf, 0.0], r"reward 1 is inf .*must be finite"),
        ([1.0, -math.inf, 0.0], r"reward 1 is -inf"),
        ([math.nan, math.nan, math.nan], r"reward 0 is nan .*return None where the reward does not apply"),
        ([1.0, 0.0, math.nan], r"reward 2 is nan"),
        (
            None,
            r"returned NoneType None; a reward function returns a list with one reward per completion \(3",
        ),
        ("1.0", r"returned str '1.0'"),
        (1.0, r"returned float 1.0"),
        ({"a": 1}, r"returned dict"),
        ([1.0, 0.0], r"returned 2 rewards for 3 completions"),
        ([1.0, "0.5", 0.0], r"reward 1 is str '0.5', not a number"),
        ([1.0, [0.5], 0.0], r"reward 1 is list"),
        ([1.0, 1j, 0.0], r"reward 1 is complex"),
        (np.zeros((3, 1)), r"array of shape \(3, 1\)"),
        (iter([1.0, 0.0, 1.0]), r"returned list_iterator"),
    ],
)
def test_a_bad_reward_is_an_error_naming_the_function_and_the_step(value, match) -> None:
    (guarded,) = guard_reward_funcs([returning(value)], ["my_reward"])
    with pytest.raises(RewardFunctionError, match=r"reward function 'my_reward' at step 7") as e:
        guarded(prompts=COMPLETIONS, completions=COMPLETIONS, trainer_state=STATE)
    assert e.match(match)


@pytest.mark.parametrize(
    "value",
    [
        [1.0, 0.0, 0.5],
        [True, False, 1],
        [1.0, None, 0.0],  # TRL's "does not apply to this completion"
        (np.float32(1.0), np.int64(0), torch.tensor(0.5)),
        [decimal.Decimal("1.5"), fractions.Fraction(1, 2), 0],  # numbers torch.tensor takes
        np.array([1.0, 0.0, 0.5]),
        torch.tensor([1.0, 0.0, 0.5]),
    ],
)
def test_good_rewards_pass_unchanged(value) -> None:
    (guarded,) = guard_reward_funcs([returning(value)], ["my_reward"])
    assert guarded(prompts=COMPLETIONS, completions=COMPLETIONS, trainer_state=STATE) is value


def test_guard_keeps_the_name_async_modules_and_pickles() -> None:
    async def async_reward(completions, **kwargs):
        return [1.0, math.nan, 0.0]

    module = torch.nn.Linear(1, 1)
    sync, asynchronous, mod = guard_reward_funcs(
        [returning([1.0] * 3), async_reward, module], ["s", "a", "m"]
    )
    assert isinstance(sync, RewardGuard) and sync.__name__ == "s"
    assert isinstance(asynchronous, AsyncRewardGuard) and mod is module
    from trl.trainer.utils import get_callable_name, is_async_callable

    assert is_async_callable(asynchronous) and not is_async_callable(sync) and get_callable_name(sync) == "s"
    with pytest.raises(RewardFunctionError, match="reward function 'a' at step 7: reward 1 is nan"):
        asyncio.run(asynchronous(completions=COMPLETIONS, trainer_state=STATE))
    assert guard_reward_funcs([sync], ["s"])[0] is sync  # never wrapped twice
    from ncgrpo.rewards import math_reward

    (g,) = guard_reward_funcs([math_reward], ["math_reward"])
    assert pickle.loads(pickle.dumps(g)).func is math_reward
    assert check_rewards("r", [1.0], 1) == [1.0]  # outside training: no step to name
    with pytest.raises(RewardFunctionError, match=r"reward function 'r' \(outside training\)"):
        check_rewards("r", None, 1)


def test_the_trainer_stops_at_the_first_step_naming_the_reward(tmp_path) -> None:
    """Through the real NCGRPOTrainer (tiny text model): before, inf trained on with zero gradient and
    no warning, and None gave TRL's "'NoneType' object is not iterable" with no function named."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "tiny_grpo", Path(__file__).parent / "scripts" / "tiny_grpo.py"
    )
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)

    def blows_up(completions, **kwargs):
        return [math.inf] * len(completions)

    from ncgrpo.trainer import NCGRPOTrainer

    tr = NCGRPOTrainer(
        model=tiny.model(0),
        reward_funcs=[blows_up],
        args=tiny.config(tmp_path, rollout_method="vanilla", max_steps=1),
        train_dataset=tiny.dataset(8),
        processing_class=tiny.processor(),
    )
    assert isinstance(tr.reward_funcs[0], RewardGuard) and tr.reward_func_names == ["blows_up"]
    with pytest.raises(RewardFunctionError, match=r"reward function 'blows_up' at step 0: reward 0 is inf"):
        tr.train()
