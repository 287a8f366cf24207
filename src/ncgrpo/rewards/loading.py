"""Reward functions by name, as TRL's ``scripts/grpo.py`` takes them: a built-in name of
:mod:`ncgrpo.rewards`, or a dotted import path ``module.function`` of one's own, imported from the
current directory or ``PYTHONPATH``.

A reward follows TRL's convention: ``def reward(prompts, completions, **kwargs) -> list[float]``,
called with keyword arguments only: ``prompts``, ``completions``, ``completion_ids``, ``trainer_state``,
``log_extra``, ``log_metric`` and every dataset column but the prompt (``answer``, ...), one list entry
per completion. :func:`check_reward_signature` binds exactly that call before anything trains, so a
function that cannot take it is refused naming what it lacks.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ncgrpo.data.prompts import build_messages
from ncgrpo.rewards import functions

__all__ = [
    "BUILTIN_REWARDS",
    "TRL_REWARD_KWARGS",
    "check_reward_signature",
    "question_columns",
    "question_rewards",
    "resolve_reward",
]

#: The built-in reward functions of :mod:`ncgrpo.rewards`, by name.
BUILTIN_REWARDS = ("math_reward", "math_reward_mathruler", "accuracy_reward", "format_reward")
#: What TRL 1.16's ``GRPOTrainer._calculate_rewards`` passes every reward function besides the columns.
TRL_REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def resolve_reward(name: str, *, what: str = "reward_funcs") -> Callable[..., Any]:
    """The reward function ``name`` stands for: a built-in (:data:`BUILTIN_REWARDS`) or ``module.attr``
    imported as TRL's script imports it (the current directory first on ``sys.path``). A ``ValueError``
    says why not: unknown name (with the closest built-in), module not importable (and what it raised),
    no such attribute, not callable."""
    if name in BUILTIN_REWARDS:
        return getattr(functions, name)
    if "." not in name or name.startswith(".") or name.endswith("."):
        near = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ValueError(
            f"{what}: unknown reward function '{name}'{hint}; give a built-in ({', '.join(BUILTIN_REWARDS)}) "
            "or a dotted import path of your own, e.g. my_rewards.exact for def exact(prompts, completions, "
            "**kwargs) in my_rewards.py"
        )
    module_name, attr = name.rsplit(".", 1)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # as TRL's scripts/grpo.py: a rewards file beside the command works
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        raise ValueError(
            f"{what}: reward function '{name}': cannot import module {module_name!r} (no module named "
            f"{missing!r}); it must be importable from the current directory ({cwd}) or PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say what it raised
        raise ValueError(
            f"{what}: reward function '{name}': importing {module_name!r} raised {type(e).__name__}: {e} "
            "(rerun with --debug for its traceback)"
        ) from e
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        defined = sorted(
            k
            for k, v in vars(module).items()
            if callable(v) and not k.startswith("_") and not isinstance(v, type)
        )
        near = difflib.get_close_matches(attr, defined, n=1)
        hint = f" (did you mean '{module_name}.{near[0]}'?)" if near else ""
        raise ValueError(f"{what}: reward function '{name}': {where} defines no {attr!r}{hint}")
    func = getattr(module, attr)
    if not callable(func) or isinstance(func, type):
        raise ValueError(
            f"{what}: reward function '{name}' is a {type(func).__name__}, not a function; point to "
            "def reward(prompts, completions, **kwargs) -> list[float]"
        )
    return func


def check_reward_signature(
    func: Callable[..., Any], name: str, columns: Sequence[str], *, what: str = "reward_funcs"
) -> None:
    """Refuse a reward function that cannot take TRL's call: keyword arguments
    :data:`TRL_REWARD_KWARGS` plus one per dataset column (``columns``, the prompt excluded). Its
    required parameters must be among those; it must take the rest by name or ``**kwargs``."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to read; TRL's own call says the rest
    passed = [*TRL_REWARD_KWARGS, *[c for c in columns if c != "prompt"]]
    try:
        sig.bind(**dict.fromkeys(passed))
    except TypeError as e:
        missing = [
            p.name
            for p in sig.parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.name not in passed
        ]
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        unexpected = [k for k in passed if k not in sig.parameters] if not takes_kwargs else []
        if unexpected:
            why = f"it takes no **kwargs, so TRL's keyword(s) {', '.join(unexpected)} would be refused"
        elif missing:
            why = (
                f"it requires {', '.join(repr(m) for m in missing)}, which is neither a column of the data "
                f"({', '.join(c for c in columns if c != 'prompt') or 'none'}) nor a TRL argument"
            )
        else:
            why = f"{e}"
        raise ValueError(
            f"{what}: reward function '{name}' {sig} cannot take TRL's reward "
            f"call: {why}. TRL calls it with keywords only: {', '.join(TRL_REWARD_KWARGS)} and each dataset "
            "column; write it as def reward(prompts, completions, **kwargs) -> list[float] (columns it reads "
            "named before **kwargs)"
        ) from None


def question_columns(question: Any) -> dict[str, Any]:
    """The dataset columns a question's reward reads, as the trainer passes them: a data file's row
    (its every column but the prompt, ``metadata["row"]``), else the built-in questions' ``answer``,
    ``choices`` and ``answer_type``."""
    row = question.metadata.get("row") if isinstance(question.metadata, dict) else None
    if row is not None:
        return dict(row)
    return {"answer": question.answer, "choices": question.choices, "answer_type": question.answer_type}


def question_rewards(
    funcs: Sequence[Callable[..., Any]], questions: Sequence[Any], texts: Sequence[str]
) -> list[float]:
    """The summed reward of each completion ``texts[i]`` of ``questions[i]``, each function called as
    TRL's trainer calls it on conversational data (``prompts`` the messages, ``completions`` one
    assistant message each, the columns of :func:`question_columns` as keywords; ``completion_ids`` empty
    lists and ``trainer_state`` None, as there is no trainer); a None reward counts 0."""

    n = len(texts)
    prompts = [build_messages(q) for q in questions]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    rows = [question_columns(q) for q in questions]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    kwargs = {k: [r.get(k) for r in rows] for k in keys}
    extra = {"completion_ids": [[] for _ in range(n)], "trainer_state": None}
    extra["log_extra"] = extra["log_metric"] = lambda *a, **k: None
    total = [0.0] * n
    for func in funcs:
        out = list(func(prompts=prompts, completions=completions, **extra, **kwargs))
        if len(out) != n:
            name = getattr(func, "__qualname__", repr(func))
            raise ValueError(f"reward function {name} returned {len(out)} rewards for {n} completions")
        total = [t + (0.0 if r is None else float(r)) for t, r in zip(total, out, strict=True)]
    return total
