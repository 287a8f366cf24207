"""The in-engine target solve's request schema and engine check, caller side (pure: no vLLM import): the
spec's ``"target"`` field (:class:`TargetSpec`, :func:`target_spec`; parsed by
:func:`ncgrpo.engines.vllm.parse_noise_spec`), and :func:`target_solve_problem`, why an engine's workers
could not solve. With a ``"target"`` the plugin solves the request's prompt's sigma in the engine, from the
request's clean last-prompt-token state (:mod:`ncgrpo.engines.vllm_solve`), so that the prompt's
noise-averaged first-token TV is ``tv`` (``target_scope: prompt``); see :mod:`ncgrpo.engines.vllm`.

The target schedule per prompt (``target_marginal_tv`` with ``target_scope: prompt``) sends ``"target"``
(build it with :func:`target_spec`)::

    {"tv": float in (0, 1], "draws": even int in [2, 1024], "temperature": float > 0,
     "start": float > 0, "sigma_max": float > 0,
     "mode": "independent" | "antithetic" | "rank_one", "rtol": float in (0, 1)  # optional, 0.02}

Then ``"sigma"`` is ignored (it may be omitted): in the engine step that samples the request's first token,
the worker solves that prompt's sigma from the request's CLEAN last-prompt-token state ``h`` -- the
:class:`~ncgrpo.core.marginal.MarginalCurve` of ``h`` and ``lm_head(h)`` on the keys
``marginal_keys(seed, step, prompt_id, draws // 2)`` at ``temperature`` in ``mode`` with the spec's
``steer``, then :func:`~ncgrpo.core.prompt_solve.solve_per_prompt` -- exactly what the transformers
engine's trainer solves on the same state (:func:`ncgrpo.trainer.generation.marginal_curve`), and perturbs
the row at it. The solve is kept per ``(seed, step, prompt_id, target)``, so every request of one prompt at
one step gets the same sigma, whichever engine step schedules it; :func:`ncgrpo.engines.vllm.target_solves` reads the solves
back (the trainer logs them). Only where the worker holds the whole LM head as a plain linear map: refused
with tensor parallelism > 1 (vLLM shards the vocabulary rows of ``ParallelLMHead`` across ranks), a
quantized head, or a logits soft-cap / scale (:func:`target_solve_problem`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["EXTRA_ARGS_KEY", "MAX_TARGET_DRAWS", "TargetSpec", "target_solve_problem", "target_spec"]

EXTRA_ARGS_KEY = "ncgrpo"
#: the rows' noise modes (:data:`ncgrpo.core.noise.NoiseMode`)
_MODES = ("independent", "antithetic", "rank_one")
_F32_MAX = torch.finfo(torch.float32).max  # sigma and logit_scale are applied in float32
_TARGET_FIELDS = {"tv", "draws", "temperature", "start", "sigma_max", "mode", "rtol"}
#: the most draws a target solve takes per prompt: one evaluation holds draws x vocabulary logits
MAX_TARGET_DRAWS = 1024


class TargetSpec:
    """A parsed ``"target"``: solve this request's prompt's sigma in the engine (see the module docstring)."""

    __slots__ = ("draws", "mode", "rtol", "sigma_max", "start", "temperature", "tv")

    def __init__(
        self,
        tv: float,
        draws: int,
        temperature: float,
        start: float,
        sigma_max: float,
        mode: str,
        rtol: float,
    ) -> None:
        self.tv, self.draws, self.temperature = tv, draws, temperature
        self.start, self.sigma_max, self.mode, self.rtol = start, sigma_max, mode, rtol

    def key(self) -> tuple:
        """What makes two requests' solves the same solve (with the noise key's seed, step, prompt_id)."""
        return (self.tv, self.draws, self.temperature, self.start, self.sigma_max, self.mode, self.rtol)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in sorted(_TARGET_FIELDS)}


def _number(target: Mapping[str, Any], name: str, ok, what: str) -> float:
    v = target.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]['target'][{name!r}] must be {what}, got {v!r}")
    return float(v)


def _parse_target(target: Any) -> TargetSpec:
    """The spec's ``"target"`` (see the module docstring), each field checked with a message naming it."""
    where = f"extra_args[{EXTRA_ARGS_KEY!r}]['target']"
    if not isinstance(target, Mapping):
        raise ValueError(f"{where} must be a dict of {sorted(_TARGET_FIELDS)}, got {type(target).__name__}")
    unknown = set(target) - _TARGET_FIELDS
    if unknown:
        raise ValueError(f"{where} has unknown fields {sorted(unknown)}; known: {sorted(_TARGET_FIELDS)}")
    missing = _TARGET_FIELDS - {"rtol"} - set(target)
    if missing:
        raise ValueError(f"{where} lacks {sorted(missing)} (required: {sorted(_TARGET_FIELDS - {'rtol'})})")
    tv = _number(target, "tv", lambda v: 0 < v <= 1, "a total-variation distance in (0, 1]")
    draws = target.get("draws")
    if (
        isinstance(draws, bool)
        or not isinstance(draws, int)
        or draws < 2
        or draws % 2
        or draws > MAX_TARGET_DRAWS
    ):
        raise ValueError(
            f"{where}['draws'] must be an even int in [2, {MAX_TARGET_DRAWS}] (antithetic pairs per prompt), "
            f"got {draws!r}"
        )
    temperature = _number(target, "temperature", lambda v: 0 < v <= _F32_MAX, "a number > 0 (the sampling T)")
    start = _number(target, "start", lambda v: 0 < v <= _F32_MAX, "a number > 0 (the solver's first sigma)")
    sigma_max = _number(
        target, "sigma_max", lambda v: 0 < v <= _F32_MAX, "a number > 0 (sigma's upper bound)"
    )
    mode = target.get("mode")
    if mode not in _MODES:
        raise ValueError(f"{where}['mode'] must be one of {_MODES} (the rows' noise mode), got {mode!r}")
    rtol = (
        _number(target, "rtol", lambda v: 0 < v < 1, "a relative tolerance in (0, 1)")
        if "rtol" in target
        else 0.02
    )
    return TargetSpec(tv, int(draws), temperature, start, sigma_max, str(mode), rtol)


def target_spec(
    tv: float,
    *,
    draws: int,
    temperature: float,
    start: float,
    sigma_max: float,
    mode: str = "independent",
    rtol: float = 0.02,
) -> dict[str, Any]:
    """The ``"target"`` field of a spec (validated here, in the caller's process): solve the prompt's sigma in
    the engine for the noise-averaged first-token TV ``tv`` (see the module docstring)."""
    out = {
        "tv": float(tv),
        "draws": int(draws),
        "temperature": float(temperature),
        "start": float(start),
        "sigma_max": float(sigma_max),
        "mode": mode,
        "rtol": float(rtol),
    }
    _parse_target(out)
    return out


def target_solve_problem(vllm_config) -> str | None:
    """Why the workers of the engine described by ``vllm_config`` cannot solve a request's sigma (the
    spec's ``"target"``), or None. The solve runs the LM head as one plain linear map ``h -> W h`` on the
    worker that samples (the control variate of :class:`~ncgrpo.core.marginal.MarginalCurve` reads ``W``),
    so it needs the whole vocabulary on that worker and nothing but the matrix between ``h`` and the
    logits: vLLM's ``ParallelLMHead`` shards the vocabulary rows across tensor-parallel ranks (each holds
    ``V / tp`` rows; gathering the head every step would copy it), and a quantized head, a logits soft-cap
    or a logit scale are not that map. The workers check the built model again
    (:func:`ncgrpo.engines.vllm_solve._target_head`)."""
    if vllm_config is None:
        return None
    tp = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if tp > 1:
        return (
            f"tensor_parallel_size={tp} shards the LM head's vocabulary across ranks (vLLM's ParallelLMHead), and "
            "the solve needs the whole head on one worker; run the engine with tensor_parallel_size=1"
        )
    mc = getattr(vllm_config, "model_config", None)
    quant = getattr(mc, "quantization", None)
    if quant:
        return f"the model is quantized ({quant}); the solve needs a plain (unquantized) LM head"
    text = getattr(mc, "hf_text_config", None)
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        return f"the model soft-caps its logits (final_logit_softcapping={cap}); the solve needs a linear LM head"
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        return f"the model scales its logits (logit_scale={scale}); the solve needs the LM head alone"
    return None
