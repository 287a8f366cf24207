"""Reward functions checked at every call: a bad reward is an error naming the function and the step.

TRL's GRPO trainer takes what a reward function returns on trust: ``None`` instead of a list, a string
or a scalar end in messages that do not name the function (``'NoneType' object is not iterable``,
``new(): invalid data type 'str'``); ``inf`` turns the group's advantages into NaN and the step's
gradient into zero with no warning; a float NaN is averaged away in the logged reward
(``nanmean``) and, for a whole group, gives zero advantages. Training goes on, learning nothing.

:func:`guard_reward_funcs` wraps each callable reward function (model rewards, ``nn.Module``, are
left alone: their output is a tensor TRL reads itself) once, in :class:`ncgrpo.trainer.NCGRPOTrainer`'s
constructor, so library users get the checks too. After every call the wrapper requires:

- a list or tuple (or a 1-D array / tensor) of exactly one reward per completion;
- each reward a real number (``bool``, ``int``, ``float``, ``Decimal``, a numpy or 0-d torch scalar)
  or ``None`` (a complex number, a string or a list is not);
- no ``inf`` and no ``NaN``.

Anything else raises :class:`RewardFunctionError` (a ``ValueError``) naming the function, the
training step and the first bad completion. Why an error for NaN rather than TRL's nan-mean: TRL's
way to say "this reward does not apply to this completion" is ``None`` (documented, and kept here:
it still becomes NaN inside TRL and is skipped by ``nansum``/``nanmean``); a float NaN is a computation
that went wrong (``0/0``, ``log(0) * 0``), and the run it silently continues learns nothing from the
affected groups. So ``None`` passes, ``NaN`` stops the run with the place to look.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AsyncRewardGuard", "RewardFunctionError", "RewardGuard", "check_rewards", "guard_reward_funcs"]


class RewardFunctionError(ValueError):
    """A reward function returned something GRPO cannot use (named with the function and the step)."""


def _step(kwargs: dict[str, Any]) -> str:
    state = kwargs.get("trainer_state")
    step = getattr(state, "global_step", None)
    return f"at step {step}" if step is not None else "(outside training)"


def _as_number(value: Any) -> float | None:
    """The reward as a float, or None when it is not a real number (strings are not numbers here)."""
    if isinstance(value, (str, bytes)):
        return None
    if isinstance(value, numbers.Real):  # bool, int, float, Fraction, numpy scalars
        return float(value)
    if isinstance(value, numbers.Number) and not isinstance(value, numbers.Complex):  # Decimal
        return float(value)
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and hasattr(value, "item"):  # 0-d tensor / array
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def check_rewards(name: str, out: Any, n: int, kwargs: dict[str, Any] | None = None) -> Any:
    """Return ``out`` if it is ``n`` rewards GRPO can use (see the module docstring), else raise
    :class:`RewardFunctionError` naming ``name``, the step (from ``kwargs['trainer_state']``) and what
    was wrong."""
    where = f"reward function '{name}' {_step(kwargs or {})}"
    if out is None or isinstance(out, (str, bytes, dict)) or isinstance(out, numbers.Number):
        raise RewardFunctionError(
            f"{where} returned {type(out).__name__} {_short(out)}; a reward function returns a list with one "
            f"reward per completion ({n} here), e.g. [1.0, 0.0, ...]"
        )
    shape = getattr(out, "shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        raise RewardFunctionError(
            f"{where} returned an array of shape {tuple(shape)}; return one reward per completion ({n}), a flat list"
        )
    if not isinstance(out, Sequence) and shape is None:
        raise RewardFunctionError(
            f"{where} returned {type(out).__name__}; return a list with one reward per completion ({n})"
        )
    values = list(out)
    if len(values) != n:
        raise RewardFunctionError(
            f"{where} returned {len(values)} rewards for {n} completions; return exactly one per completion"
        )
    for i, v in enumerate(values):
        if v is None:
            continue  # TRL's "does not apply to this completion"
        x = _as_number(v)
        if x is None:
            raise RewardFunctionError(
                f"{where}: reward {i} is {type(v).__name__} {_short(v)}, not a number; return numbers "
                "(or None where the reward does not apply)"
            )
        if not math.isfinite(x):
            raise RewardFunctionError(
                f"{where}: reward {i} is {x} (completion {i} of {n}); rewards must be finite: {x} makes the "
                "group's advantages NaN and the step learns nothing. Fix the computation, or return None where "
                "the reward does not apply (TRL's convention)"
            )
    return out


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


class RewardGuard:
    """A synchronous reward function checked after every call (:func:`check_rewards`); picklable, and
    named as the function it wraps (TRL logs ``rewards/<name>/mean``)."""

    def __init__(self, func: Callable[..., Any], name: str):
        self.func = func
        self.name = name
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.func(*args, **kwargs)
        return check_rewards(self.name, out, _count(args, kwargs), kwargs)

    def __repr__(self) -> str:
        return f"RewardGuard({self.func!r})"


class AsyncRewardGuard(RewardGuard):
    """:class:`RewardGuard` for an ``async`` reward function (TRL awaits it)."""

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = await self.func(*args, **kwargs)
        return check_rewards(self.name, out, _count(args, kwargs), kwargs)


def _count(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    for key in ("completions", "prompts", "completion_ids"):
        if key in kwargs and kwargs[key] is not None:
            return len(kwargs[key])
    return len(args[0]) if args else 0


def guard_reward_funcs(funcs: list[Any], names: Sequence[str]) -> list[Any]:
    """``funcs`` with each callable (not ``nn.Module``, not already guarded) wrapped in a
    :class:`RewardGuard` named by ``names`` (the trainer's ``reward_func_names``)."""
    from trl.trainer.utils import is_async_callable

    try:
        from torch import nn

        module = nn.Module
    except ImportError:  # pragma: no cover - torch is a dependency
        module = ()
    out = []
    for func, name in zip(funcs, names, strict=True):
        if isinstance(func, (RewardGuard, module)) or not callable(func):
            out.append(func)
        elif is_async_callable(func):
            out.append(AsyncRewardGuard(func, name))
        else:
            out.append(RewardGuard(func, name))
    return out
