"""The vLLM plugin's in-engine target solve, worker side (``target_scope: prompt``; the request schema is
:mod:`ncgrpo.engines.vllm_target`): in the engine step that samples a request's first token, a spec's
``"target"`` is replaced by a plain spec at its prompt's sigma, solved from the request's clean
last-prompt-token state through the model's own LM head (:func:`_resolve_targets`, called by
:class:`ncgrpo.engines.vllm_worker._ArmedLogits` before eq. (2)); the solves are kept per ``(seed, step,
prompt_id, target)`` so every request of one prompt at one step gets one sigma, and read back by the RPC
``ncgrpo_target_solves`` (:func:`_target_solves`; caller side :func:`ncgrpo.engines.vllm.target_solves`)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any

import torch

from ncgrpo.core.marginal import MarginalCurve, marginal_keys
from ncgrpo.core.noise import RowNoise
from ncgrpo.core.prompt_solve import solve_per_prompt
from ncgrpo.engines.vllm import NoiseSpec

__all__ = ["SOLVE_STATS", "SOLVE_STEPS_KEPT"]

#: this worker process's solves and the seconds they took (the start-up check's status RPC reports them)
SOLVE_STATS = {"target_solves": 0, "target_solve_seconds": 0.0}

#: the in-engine target solves of this worker process, per (seed, step), oldest first:
#: ``{(seed, step): {(prompt_id, target key): entry}}``; the last SOLVE_STEPS_KEPT (seed, step) pairs kept
_SOLVES: OrderedDict[tuple[int, int], dict[tuple, dict[str, Any]]] = OrderedDict()
SOLVE_STEPS_KEPT = 16


def _target_head(model):
    """``(head, problem)``: the model's LM head as the plain linear map the solve needs -- ``head(x) =
    F.linear(x, W)`` with ``W`` the head's first ``org_vocab_size`` rows (vLLM pads the vocabulary to a
    multiple of 64; the padding rows are dropped exactly as ``LogitsProcessor`` drops those logits), in
    vLLM's head dtype, carrying ``W`` as ``.weight`` (:class:`~ncgrpo.core.marginal.MarginalCurve`'s control
    variate) -- or ``(None, why not)``. The head is read from the model itself (``lm_head`` and
    ``logits_processor``, on the model or its language model for VLMs; with ``tie_word_embeddings`` vLLM's
    ``lm_head`` IS the embedding, the same rows), not through ``compute_logits``, so a wrapper there
    (verl's -inf mask of the tokens past the tokenizer) does not reach the solve: it solves on the head
    the transformers engine's trainer solves on (``head_function(lm_head)``)."""
    lm = None
    for cand in (model, getattr(model, "language_model", None)):
        if cand is not None and hasattr(cand, "lm_head") and hasattr(cand, "logits_processor"):
            lm = cand
            break
    if lm is None and callable(getattr(model, "get_language_model", None)):
        cand = model.get_language_model()
        if hasattr(cand, "lm_head") and hasattr(cand, "logits_processor"):
            lm = cand
    out = None, None
    if lm is None:
        out = None, f"{type(model).__name__} has no lm_head and logits_processor the plugin can find"
    else:
        lm_head, lp = lm.lm_head, lm.logits_processor
        weight = getattr(lm_head, "weight", None)
        method = type(getattr(lm_head, "quant_method", None)).__name__
        if int(getattr(lm_head, "tp_size", 1) or 1) > 1:
            out = None, f"the LM head's vocabulary is sharded over {lm_head.tp_size} tensor-parallel ranks"
        elif method not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "NoneType"):
            out = None, f"the LM head is quantized ({method})"
        elif getattr(lp, "soft_cap", None) is not None or float(getattr(lp, "scale", 1.0)) != 1.0:
            out = None, "the logits processor soft-caps or scales the logits"
        elif (
            getattr(lp, "logits_as_input", False) or not isinstance(weight, torch.Tensor) or weight.dim() != 2
        ):
            out = None, "the model has no linear LM head weight"
        elif getattr(lm_head, "bias", None) is not None:
            out = None, "the LM head has a bias"
        else:
            V = int(getattr(lp, "org_vocab_size", weight.shape[0]))
            dtype = getattr(lp, "head_dtype", None) or weight.dtype
            W = weight[:V] if dtype == weight.dtype else weight[:V].to(dtype)  # a copy only under head_dtype

            def head(x: torch.Tensor) -> torch.Tensor:
                return torch.nn.functional.linear(x.to(W.dtype), W)

            head.weight = W  # type: ignore[attr-defined]
            out = head, None
    return out  # built per step that solves (not kept: a weight sync may replace the head's tensor)


def _keep_solves(seed: int, step: int) -> dict[tuple, dict[str, Any]]:
    """This (seed, step)'s solves, created if new; drops the oldest steps beyond SOLVE_STEPS_KEPT."""
    k = (seed, step)
    if k in _SOLVES:
        _SOLVES.move_to_end(k)
        return _SOLVES[k]
    _SOLVES[k] = {}
    while len(_SOLVES) > SOLVE_STEPS_KEPT:
        _SOLVES.popitem(last=False)
    return _SOLVES[k]


def _solve_one(head, h: torch.Tensor, spec: NoiseSpec) -> dict[str, Any]:
    """One prompt's solve from its clean state ``h`` ``# [d]``: the transformers-side computation
    (:func:`ncgrpo.trainer.generation.marginal_curve` then :func:`~ncgrpo.core.prompt_solve.solve_per_prompt`)
    on the same keys, temperature, mode and steer."""
    t, key = spec.target, spec.row.key
    with torch.no_grad():
        hs = h[None]
        z = head(hs).float()  # [1, V] the clean logits, through the same head
        steer = None if spec.steer is None else spec.steer.to(h.device)
        curve = MarginalCurve(
            head,
            hs,
            z,
            marginal_keys(key.seed, key.step, key.prompt_id, t.draws // 2),
            temperature=t.temperature,
            mode=t.mode,
            steer=steer,
        )
        found = solve_per_prompt(curve, t.tv, start=t.start, sigma_max=t.sigma_max, rtol=t.rtol)
    sigma, tv = float(found.sigma[0]), float(found.tv[0])
    error = None
    if not (math.isfinite(sigma) and sigma >= 0):  # e.g. a non-finite state: the row is left clean
        error, sigma = f"the solve gave sigma={sigma} (TV {tv}) from this prompt's state", 0.0
    return {
        "sigma": sigma,
        "tv": tv,
        "evals": int(found.prompt_evals[0]),
        "at_max": bool(found.at_max[0]),
        "error": error,
    }


def _resolve_targets(
    model, hs: torch.Tensor, rows: list[tuple[int, NoiseSpec]]
) -> list[tuple[int, NoiseSpec]]:
    """``rows`` with each target spec replaced by a plain one at its prompt's solved sigma: from the cache
    when this prompt was solved at this step already (every request of a prompt gets one sigma), else solved
    now on this row's clean state ``hs[row]``. Never raises (an exception here would stop the engine and
    every request in it): a failed solve is recorded with its ``error`` and its rows are left clean."""
    if not any(s.target is not None for _, s in rows):
        return rows
    t0 = time.perf_counter()
    out = []
    head = problem = None
    for i, spec in rows:
        if spec.target is None:
            out.append((i, spec))
            continue
        key = spec.row.key
        solves = _keep_solves(int(key.seed), int(key.step))
        ck = (int(key.prompt_id), spec.target.key())
        entry = solves.get(ck)
        if entry is None:
            try:
                if head is None and problem is None:
                    head, problem = _target_head(model)
                if problem is not None:
                    raise RuntimeError(problem)
                found = _solve_one(head, hs[i], spec)
            except Exception as e:  # noqa: BLE001 -- recorded and read back by the trainer, which raises
                found = {"sigma": 0.0, "tv": float("nan"), "evals": 0, "at_max": False, "error": repr(e)}
            entry = solves[ck] = {
                "seed": int(key.seed),
                "step": int(key.step),
                "prompt_id": int(key.prompt_id),
                "target_tv": spec.target.tv,
                **found,
            }
            SOLVE_STATS["target_solves"] += 1
        row = RowNoise(entry["sigma"], key, spec.row.sign, spec.row.mode)
        out.append((i, NoiseSpec(row, spec.steer, spec.logit_scale)))
    SOLVE_STATS["target_solve_seconds"] += time.perf_counter() - t0
    return out


def _target_solves(worker, seed, step) -> list[dict[str, Any]]:
    """The RPC ``ncgrpo_target_solves``: this worker's solves at ``(seed, step)`` (ints, or their decimal
    strings: vLLM's HTTP ``/collective_rpc`` passes its args through)."""
    solves = _SOLVES.get((int(seed), int(step)), {})
    return [dict(e) for e in solves.values()]
