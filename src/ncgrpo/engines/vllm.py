"""The vLLM engine hook, caller side: the request schema of NC-GRPO's vLLM general plugin.

Same intervention as :mod:`ncgrpo.engines.transformers` (paper section 3.1, "Where the perturbation
acts"): eq. (2) is applied to the hidden state *returned* by the language-model stack (after the
final norm) at the LAST prompt position, in the engine step that samples a request's first token.
The KV cache is written inside the forward from clean activations, so only that one logit row moves;
every later step decodes from a clean cache. The noise is :func:`ncgrpo.core.noise.perturb_selected`
(its sync-free option) with the keyed draw at reverse position 0 -- the very function the transformers
engine's :func:`~ncgrpo.core.noise.perturb_rows` calls -- so a request gets bit-for-bit the same ``eps``
in both engines.

The plugin itself (the patches of vLLM's model runners, and of ``SamplingParams`` and the input
processor where a request is admitted) is :mod:`ncgrpo.engines.vllm_worker`. Installing ncgrpo
registers it (entry point ``vllm.general_plugins``); vLLM loads it in every process it starts, workers
included (TRL colocate, ``vllm serve``, verl workers). Requests opt in through
``SamplingParams.extra_args``; a batch with no such request runs vLLM's code untouched.

Request schema, ``extra_args["ncgrpo"]`` (build it with :func:`noise_extra_args`)::

    {"seed": int, "step": int, "prompt_id": int, "draw": int,     # the NoiseKey
     "sigma": float >= 0,                                         # eq. (2)'s sigma_k
     "sign": 1 | -1,              # optional, default 1; -1 = antithetic partner (same key)
     "mode": "independent" | "antithetic" | "rank_one",           # optional, default independent
     "steer": [float] * d,        # optional: eq. (6)'s mu, added to noisy rows
     "site": "final_norm",        # optional; any other site is refused (see vllm_worker)
     "target": {...}}             # optional: solve sigma per prompt in the engine (below)

The target schedule per prompt (``target_marginal_tv`` with ``target_scope: prompt``) sends ``"target"``
(:mod:`ncgrpo.engines.vllm_target`: its schema and the engines that cannot solve); the worker solves the
prompt's sigma in the engine (:mod:`ncgrpo.engines.vllm_solve`) and :func:`target_solves` reads it back.

Through vLLM's OpenAI-compatible server the same spec goes in the request's ``vllm_xargs`` as a JSON
string (``vllm_xargs`` values cannot be dicts; :func:`server_extra_args`), which the parser decodes;
:func:`generate_rows_on_server` makes TRL's server-mode call per spec.

The matched first-token temperature control (no hidden noise) sends ``{"logit_scale": T / T_k}`` alone
(:func:`control_extra_args`): the request's first-token logit row is multiplied by it, so vLLM's
sampler, dividing by the sampling temperature ``T``, samples that token at ``T_k``; later tokens are
untouched. A spec may carry both (noise, then the scale).

Nothing a request carries can fail inside a worker (where any exception kills the engine, and a
server with it): the spec is parsed when its ``SamplingParams`` is built, and checked against the
engine (``steer`` of the model's hidden size, no feature the plugin cannot follow) where vLLM admits
the request (``InputProcessor._validate_params``, the caller's or the API server's process:
:func:`check_spec_for_engine`); a bad request is a ValueError / HTTP 400 for itself alone. In the
worker the perturbation never syncs with the device
(:func:`~ncgrpo.engines.vllm_worker._perturb_logit_rows`).

Start-up check: :func:`check_plugin_active` asks every worker (``collective_rpc``) whether the
patches are in place, and raises if not, or if the engine runs a feature the plugin cannot follow
(:func:`unsupported_engine_features`: batch-sharded sampling, models that sample other than one
token per step). Call it once after building the ``LLM``.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ncgrpo.core.noise import NoiseKey, RowNoise
from ncgrpo.engines.vllm_target import (
    _F32_MAX,
    _MODES,
    EXTRA_ARGS_KEY,
    TargetSpec,
    _parse_target,
    target_solve_problem,
    target_spec,
)

__all__ = [
    "EXTRA_ARGS_KEY",
    "NoiseSpec",
    "check_plugin_active",
    "check_server_plugin_active",
    "check_spec_for_engine",
    "control_extra_args",
    "generate_rows_on_server",
    "noise_extra_args",
    "parse_noise_spec",
    "sampling_params_for_rows",
    "server_extra_args",
    "target_solve_problem",
    "target_solves",
    "target_spec",
    "TARGET_SOLVES_RPC",
    "TargetSpec",
    "unsupported_engine_features",
]

_STATUS_METHOD = "ncgrpo_noise_status"
#: the workers' read-back of the in-engine target solves (:func:`target_solves`): ``(seed, step) -> [dict]``
TARGET_SOLVES_RPC = "ncgrpo_target_solves"
_FIELDS = {
    "seed", "step", "prompt_id", "draw", "sigma", "sign", "mode", "steer", "site", "logit_scale", "target"
}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the request schema
# --------------------------------------------------------------------------------------------------
class NoiseSpec:
    """A parsed ``extra_args["ncgrpo"]``: the :class:`~ncgrpo.core.noise.RowNoise` plus the optional mu,
    logit scale and in-engine target solve."""

    __slots__ = ("logit_scale", "row", "steer", "target")

    def __init__(
        self,
        row: RowNoise,
        steer: torch.Tensor | None = None,
        logit_scale: float | None = None,
        target: TargetSpec | None = None,
    ) -> None:
        self.row = row
        self.steer = steer  # [d] float32 or None
        self.logit_scale = logit_scale  # first-token logit multiplier (the temperature control) or None
        self.target = target  # solve sigma in the engine (row.sigma is then replaced by the solved one)

    @property
    def noisy(self) -> bool:
        """Whether this request's first-token row is changed at all (noise, a target solve, a logit scale)."""
        return self.row.noisy or self.target is not None or self.logit_scale is not None


# noise_seed packs each key field into 16 signed bytes: a wider int would raise OverflowError in the
# worker's draw, so it is refused here, where the spec is parsed (the caller's process)
_KEY_BOUND = 1 << 127


def _int(spec: Mapping[str, Any], name: str) -> int:
    v = spec.get(name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}][{name!r}] must be an int, got {v!r}")
    if not -_KEY_BOUND <= v < _KEY_BOUND:
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}][{name!r}] = {v} does not fit the noise key's 128-bit signed field"
        )
    return v


def parse_noise_spec(extra_args: Mapping[str, Any] | None) -> NoiseSpec | None:
    """The request's noise spec, or None when it asks for none. Malformed specs raise ValueError."""
    if not extra_args or EXTRA_ARGS_KEY not in extra_args:
        return None
    spec = extra_args[EXTRA_ARGS_KEY]
    if spec is None:
        return None
    if isinstance(spec, str):  # the server form (server_extra_args): vllm_xargs values cannot be dicts
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError(
                f"extra_args[{EXTRA_ARGS_KEY!r}] is a string but not JSON: {spec[:80]!r}; send the spec as a dict "
                "(offline LLM) or json.dumps of it (server vllm_xargs, see server_extra_args)"
            ) from None
    if not isinstance(spec, Mapping):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict, got {type(spec).__name__}")
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}] has unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}"
        )
    scale = spec.get("logit_scale")
    if scale is not None and (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
        or scale > _F32_MAX
    ):
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}]['logit_scale'] must be a number > 0 and finite in float32, got {scale!r}"
        )
    scale = None if scale is None else float(scale)
    if set(spec) <= {"logit_scale"}:  # the temperature control alone: no noise key
        return NoiseSpec(RowNoise(), None, scale)
    target = None
    if spec.get("target") is not None:
        target = _parse_target(spec["target"])
    site = spec.get("site", "final_norm")
    if site != "final_norm":
        raise ValueError(
            f"the vLLM engine supports only the final-norm site, got site={site!r}: a layer (propagating) site "
            "writes noise into the KV cache of every prompt token, which vLLM's prefix cache shares between "
            "requests and chunked prefill splits. Run that ablation with the transformers engine."
        )
    if target is not None and not {"seed", "step", "prompt_id", "draw"} <= set(spec):
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}]['target'] needs the noise key (seed, step, prompt_id, draw): the "
            "solve's draws and the row's noise are keyed on it"
        )
    key = NoiseKey(_int(spec, "seed"), _int(spec, "step"), _int(spec, "prompt_id"), _int(spec, "draw"))
    sigma = spec.get("sigma", 0.0 if target is not None else None)  # with a target: ignored, may be omitted
    if (
        isinstance(sigma, bool)
        or not isinstance(sigma, (int, float))
        or not math.isfinite(sigma)
        or sigma < 0
        or sigma > _F32_MAX
    ):
        raise ValueError(  # a sigma past float32's range would turn the row's logits into NaN, silently
            f"extra_args[{EXTRA_ARGS_KEY!r}]['sigma'] must be a number >= 0 and finite in float32, got {sigma!r}"
        )
    sign = spec.get("sign", 1)
    if sign not in (1, -1, 1.0, -1.0) or isinstance(sign, bool):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]['sign'] must be 1 or -1, got {sign!r}")
    mode = spec.get("mode", "independent")
    if mode not in _MODES:
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}]['mode'] must be one of {_MODES}, got {mode!r}")
    steer = spec.get("steer")
    if steer is not None:
        steer = torch.as_tensor(steer, dtype=torch.float32)
        if steer.dim() != 1 or not torch.isfinite(steer).all():
            raise ValueError(
                f"extra_args[{EXTRA_ARGS_KEY!r}]['steer'] must be a finite 1-D list of floats (mu, [d])"
            )
    if target is not None:
        sigma = 0.0  # the worker solves it
    return NoiseSpec(RowNoise(float(sigma), key, float(sign), mode), steer, scale, target)


def control_extra_args(logit_scale: float) -> dict[str, Any]:
    """``extra_args`` of a first-token-temperature control row: its first-token logits times
    ``logit_scale`` (``T / T_k``), no hidden-state noise."""
    spec = {"logit_scale": float(logit_scale)}
    parse_noise_spec({EXTRA_ARGS_KEY: spec})  # validate here, not in a worker
    return {EXTRA_ARGS_KEY: spec}


def noise_extra_args(
    row: RowNoise,
    *,
    steer: torch.Tensor | Sequence[float] | None = None,
    target: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``extra_args`` for one request from its :class:`~ncgrpo.core.noise.RowNoise` (``{}`` for a clean row).

    A noisy-half row whose sigma annealed to 0 is sent with sigma 0 (the plugin then leaves it exact).
    ``target``: a :func:`target_spec` (the row's sigma is then solved in the engine; sent as 0).
    """
    if row.key is None:
        if target is not None:
            raise ValueError(
                "a target solve needs a noisy row (a row with a noise key); clean rows carry none"
            )
        return {}
    spec: dict[str, Any] = {
        "seed": int(row.key.seed),
        "step": int(row.key.step),
        "prompt_id": int(row.key.prompt_id),
        "draw": int(row.key.draw),
        "sigma": float(row.sigma),
        "sign": 1 if row.sign >= 0 else -1,
        "mode": row.mode,
    }
    if steer is not None:
        spec["steer"] = [float(x) for x in torch.as_tensor(steer, dtype=torch.float32).tolist()]
    if target is not None:
        spec["target"] = dict(target)
        spec["sigma"] = 0.0  # ignored: the worker solves it
    parse_noise_spec({EXTRA_ARGS_KEY: spec})  # validate here, not in a worker
    return {EXTRA_ARGS_KEY: spec}


def sampling_params_for_rows(
    base,
    rows: Sequence[RowNoise],
    *,
    steer=None,
    logit_scales: Sequence[float | None] | None = None,
    targets: Sequence[Mapping[str, Any] | None] | None = None,
) -> list:
    """One ``SamplingParams`` per row: clones of ``base`` (``n`` must be 1) carrying each row's spec;
    ``logit_scales``: per row, the control's first-token logit scale (``None``: none); ``targets``: per row,
    a :func:`target_spec` (``None``: the row's own sigma)."""
    if getattr(base, "n", 1) != 1:
        raise ValueError(f"one request per row: base SamplingParams must have n=1, got n={base.n}")
    if logit_scales is not None and len(logit_scales) != len(rows):
        raise ValueError(f"{len(logit_scales)} logit scales for {len(rows)} rows")
    if targets is not None and len(targets) != len(rows):
        raise ValueError(f"{len(targets)} targets for {len(rows)} rows")
    out = []
    for i, row in enumerate(rows):
        sp = base.clone()
        extra = dict(base.extra_args or {})
        extra.pop(EXTRA_ARGS_KEY, None)
        extra.update(noise_extra_args(row, steer=steer, target=None if targets is None else targets[i]))
        scale = None if logit_scales is None else logit_scales[i]
        if scale is not None:
            spec = dict(extra.get(EXTRA_ARGS_KEY, {}), logit_scale=float(scale))
            extra.update({EXTRA_ARGS_KEY: spec})
            parse_noise_spec(extra)
        sp.extra_args = extra or None
        out.append(sp)
    return out


# --------------------------------------------------------------------------------------------------
# what an engine can apply: checked in the caller's process, before a request reaches a worker
# --------------------------------------------------------------------------------------------------
def unsupported_engine_features(vllm_config) -> list[str]:
    """The features of this engine configuration under which the plugin cannot perturb the right row
    (empty: none). Both are V2-runner features of vLLM 0.30-0.33; older configs lack the fields.

    - batch-sharded sampling (``parallel_config.enable_batch_sharded_sampling``, TP > 1): each rank
      computes the logits of its own subset of requests from ``compute_logits_local``, not the
      ``compute_logits`` call the plugin wraps;
    - diffusion models (``model_config.is_diffusion``): they sample several tokens per step, or none
      (``num_new_sampled_tokens_per_step != 1``), so there is no single first-token logit row.
    """
    out = []
    if getattr(getattr(vllm_config, "parallel_config", None), "enable_batch_sharded_sampling", False):
        out.append("batch-sharded sampling (enable_batch_sharded_sampling)")
    if getattr(getattr(vllm_config, "model_config", None), "is_diffusion", False):
        out.append("a model that samples other than one token per step (a diffusion model)")
    return out


def check_spec_for_engine(spec: NoiseSpec | None, vllm_config) -> None:
    """Raise ValueError unless the engine described by ``vllm_config`` can apply ``spec``.

    Runs in the process that admits the request (``LLM.generate``'s, or the API server's, where a
    ValueError is a 400 for that request alone), so nothing that would fail inside a worker, where
    any exception kills the engine and every request in it, ever reaches one: ``steer`` must have the
    model's hidden size, and the engine must not run a feature :func:`unsupported_engine_features`
    lists.
    """
    if spec is None or not spec.noisy:
        return
    if spec.target is not None:
        problem = target_solve_problem(vllm_config)
        if problem is not None:
            raise ValueError(
                f"extra_args[{EXTRA_ARGS_KEY!r}]['target']: the engine cannot solve sigma in its workers: {problem}. "
                "Send the row's sigma instead (target_scope='batch' solves one sigma in the trainer)"
            )
    if spec.steer is not None and (spec.row.noisy or spec.target is not None):
        d = int(vllm_config.model_config.get_hidden_size())
        if spec.steer.numel() != d:
            raise ValueError(
                f"extra_args[{EXTRA_ARGS_KEY!r}]['steer'] has {spec.steer.numel()} values, but the model's hidden "
                f"size is {d}: steer is eq. (6)'s mu, one value per hidden dimension"
            )
    bad = unsupported_engine_features(vllm_config)
    if bad:
        raise ValueError(
            f"extra_args[{EXTRA_ARGS_KEY!r}]: the ncgrpo noise cannot be applied by this engine, which runs "
            f"{' and '.join(bad)}; start it without that to send NC-GRPO requests"
        )


# --------------------------------------------------------------------------------------------------
# vLLM's OpenAI-compatible server (`vllm serve`, `trl vllm-serve`): one HTTP request per spec
# --------------------------------------------------------------------------------------------------
def server_extra_args(
    row: RowNoise | None,
    *,
    steer=None,
    logit_scale: float | None = None,
    target: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """The row's spec for a server request's ``vllm_xargs`` (``{}`` for a clean row): the same spec as
    :func:`noise_extra_args` / :func:`control_extra_args`, JSON-encoded, because the server's request
    schema only admits strings, numbers and lists as ``vllm_xargs`` values (a dict is a 400). vLLM
    copies ``vllm_xargs`` into ``SamplingParams.extra_args``; :func:`parse_noise_spec` decodes it."""
    if row is None and target is not None:
        raise ValueError("a target solve needs a noisy row (a row with a noise key); clean rows carry none")
    extra = noise_extra_args(row, steer=steer, target=target) if row is not None else {}
    spec = dict(extra.get(EXTRA_ARGS_KEY, {}))
    if logit_scale is not None:
        spec["logit_scale"] = float(logit_scale)
    if not spec:
        return {}
    parse_noise_spec({EXTRA_ARGS_KEY: spec})
    return {EXTRA_ARGS_KEY: json.dumps(spec, sort_keys=True)}


def generate_rows_on_server(
    client_generate,
    prompts: Sequence,
    n: int,
    rows: Sequence[RowNoise],
    *,
    steer=None,
    logit_scales: Sequence[float | None] | None = None,
    targets: Sequence[Mapping[str, Any] | None] | None = None,
    features: Sequence | None = None,
    generation_kwargs: Mapping[str, Any] | None = None,
    max_workers: int = 32,
    **sampling,
) -> dict[str, Any]:
    """TRL's server-mode call ``client.generate(prompts, n=G, ...)`` (one shared SamplingParams, ``n``
    completions per prompt), made per spec: row ``j * n + c`` (prompt ``j``, completion ``c``, TRL's
    prompt-major order) gets its own request carrying its spec in ``vllm_xargs``; consecutive rows of a
    prompt with no spec (the clean half) share one request with ``n`` = their count. Requests go out
    concurrently (the server batches them). Returns what ``client_generate`` returns for the whole call:
    ``prompt_ids`` (one per prompt), ``completion_ids`` / ``logprobs`` / ``logprob_token_ids`` (one per
    row, in row order).

    ``client_generate``: ``trl.generation.vllm_client.VLLMClient.generate`` (or anything with its
    signature); ``sampling``: its other keyword arguments, passed through unchanged. ``targets``: per row, a
    :func:`target_spec` (the row's sigma solved in the server's workers; read back with :func:`target_solves`).
    """

    if len(prompts) * n != len(rows):
        raise ValueError(
            f"{len(prompts)} prompts x n={n} = {len(prompts) * n} completions, but {len(rows)} row specs: the "
            "trainer's row plan does not match the server request"
        )
    if logit_scales is not None and len(logit_scales) != len(rows):
        raise ValueError(f"{len(logit_scales)} logit scales for {len(rows)} rows")
    if targets is not None and len(targets) != len(rows):
        raise ValueError(f"{len(targets)} targets for {len(rows)} rows")
    if features is not None and len(features) != len(prompts):
        raise ValueError(f"{len(features)} feature entries for {len(prompts)} prompts")
    base_kwargs = dict(generation_kwargs or {})
    base_xargs = dict(base_kwargs.pop("vllm_xargs", None) or {})
    base_xargs.pop(EXTRA_ARGS_KEY, None)
    # (prompt index, first row, count, xargs)
    requests: list[tuple[int, int, int, dict]] = []
    for j in range(len(prompts)):
        for c in range(n):
            r = j * n + c
            scale = None if logit_scales is None else logit_scales[r]
            target = None if targets is None else targets[r]
            xargs = server_extra_args(rows[r], steer=steer, logit_scale=scale, target=target)
            prev = requests[-1] if requests else None
            if not xargs and prev is not None and prev[0] == j and not prev[3] and prev[1] + prev[2] == r:
                requests[-1] = (j, prev[1], prev[2] + 1, prev[3])
            else:
                requests.append((j, r, 1, xargs))

    def send(req):
        j, _, count, xargs = req
        kwargs = dict(base_kwargs)
        if base_xargs or xargs:
            kwargs["vllm_xargs"] = {**base_xargs, **xargs}
        return client_generate(
            prompts=[prompts[j]],
            features=None if features is None else [features[j]],
            n=count,
            generation_kwargs=kwargs,
            **sampling,
        )

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(requests)))) as pool:
        outs = list(pool.map(send, requests))
    prompt_ids: list = [None] * len(prompts)
    completion_ids: list = [None] * len(rows)
    logprobs: list | None = [None] * len(rows)
    token_ids: list | None = [None] * len(rows)
    for (j, first, count, _), out in zip(requests, outs, strict=True):
        if len(out["completion_ids"]) != count:
            raise RuntimeError(f"the server returned {len(out['completion_ids'])} completions for n={count}")
        if prompt_ids[j] is None:
            prompt_ids[j] = out["prompt_ids"][0]
        completion_ids[first : first + count] = out["completion_ids"]
        if logprobs is not None and out.get("logprobs") is not None:
            logprobs[first : first + count] = out["logprobs"]
        else:
            logprobs = None
        if token_ids is not None and out.get("logprob_token_ids") is not None:
            token_ids[first : first + count] = out["logprob_token_ids"]
        else:
            token_ids = None
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "logprobs": logprobs,
        "logprob_token_ids": token_ids,
    }


def _post_json(url: str, payload: dict, timeout: float) -> tuple[int, str]:
    """POST ``payload`` as JSON; ``(status code, body)``, HTTP errors included (stdlib only)."""

    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def check_server_plugin_active(base_url: str, *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """:func:`check_plugin_active` for a running server: asks every worker through the server's
    ``POST /collective_rpc`` (a dev-mode endpoint: ``trl vllm-serve`` runs the server with
    ``VLLM_SERVER_DEV_MODE=1``, which its weight sync needs anyway) and raises unless each one runs the
    patched model runner."""
    url = f"{base_url.rstrip('/')}/collective_rpc"
    code, text = _post_json(url, {"method": _STATUS_METHOD}, timeout)
    if code == 404:
        raise RuntimeError(
            f"{url} does not exist: start the server with VLLM_SERVER_DEV_MODE=1 (`trl vllm-serve` does) so the "
            "ncgrpo plugin can be checked in its workers"
        )
    if code != 200:
        raise RuntimeError(
            f"the ncgrpo vLLM plugin is not active in the server's workers ({code}: {text[:300]}): "
            "install ncgrpo in the environment that runs `vllm serve` (entry point 'ncgrpo_noise' in "
            "'vllm.general_plugins') and do not exclude it with VLLM_PLUGINS"
        )
    status = json.loads(text).get("results")
    bad = [s for s in status or [] if not (isinstance(s, dict) and s.get("patched"))]
    if not status or bad:
        raise RuntimeError(f"the ncgrpo vLLM plugin is not active in the server's workers: {status}")
    _refuse_unsupported(status)
    return list(status)


# --------------------------------------------------------------------------------------------------
# the start-up check: asks the workers' status RPC (ncgrpo.engines.vllm_worker._status)
# --------------------------------------------------------------------------------------------------
def check_plugin_active(llm) -> list[dict[str, Any]]:
    """Raise unless every worker of ``llm`` (a ``vllm.LLM``) runs a model runner patched by this plugin.

    Returns each worker's ``{"runner", "kind", "patched", "plugin_seconds", "perturbed_rows",
    "resumed_requests"}`` (the last three: time spent in the plugin's code, rows perturbed and
    requests resumed after preemption so far, in that worker; the last is counted by the V1 runner). Call once after building the engine: a
    missing plugin would otherwise make every noisy row silently clean.
    """
    try:
        status = llm.collective_rpc(_STATUS_METHOD)
    except Exception as e:  # in-process workers raise NotImplementedError; multiprocess ones wrap it
        if _STATUS_METHOD not in str(e):
            raise
        raise RuntimeError(
            "the ncgrpo vLLM plugin is not active in the engine's workers: install ncgrpo in the environment "
            "that runs vLLM (it registers the 'vllm.general_plugins' entry point 'ncgrpo_noise') and do not "
            "exclude it with VLLM_PLUGINS"
        ) from e
    bad = [s for s in status if not s.get("patched")]
    if bad:
        raise RuntimeError(f"the ncgrpo vLLM plugin is loaded but the model runner is not patched: {bad}")
    _refuse_unsupported(status)
    return list(status)


def _refuse_unsupported(status: Sequence[Mapping[str, Any]]) -> None:
    """The start-up refusal of an engine the plugin cannot perturb correctly (its workers' report)."""
    bad = sorted({u for s in status for u in s.get("unsupported", ())})
    if bad:
        raise RuntimeError(
            f"the ncgrpo vLLM plugin cannot apply NC-GRPO noise in this engine, which runs {' and '.join(bad)}: "
            "every noisy request would be refused; start the engine without it"
        )


# --------------------------------------------------------------------------------------------------
# the read-back of the in-engine target solves (ncgrpo.engines.vllm_solve._target_solves)
# --------------------------------------------------------------------------------------------------
def target_solves(engine, seed: int, step: int, *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The sigmas the engine's workers solved for requests carrying a ``"target"`` with noise key ``seed`` /
    ``step``: one dict per prompt (and target), ``{"seed", "step", "prompt_id", "sigma", "tv", "evals",
    "at_max", "target_tv", "error"}`` -- ``tv`` the prompt's noise-averaged first-token TV at ``sigma`` as the
    solve estimated it, ``evals`` its evaluations, ``at_max`` whether ``sigma_max`` bound it, ``error`` None or
    why the worker could not solve (that row was then generated clean: the engine is never stopped by a
    request). Sorted by ``prompt_id``; one entry per prompt whichever worker (data-parallel rank) solved it.

    ``engine``: a ``vllm.LLM`` (``collective_rpc``), or a server: its base URL or an object with ``.base_url``
    (TRL's ``VLLMClient``), asked through ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``, as for
    :func:`check_server_plugin_active`). The workers keep the solves of their last steps only
    (``vllm_solve.SOLVE_STEPS_KEPT`` pairs of (seed, step)): read them back after each generation."""
    if isinstance(engine, str) or hasattr(engine, "base_url") and not hasattr(engine, "collective_rpc"):
        base = engine if isinstance(engine, str) else engine.base_url
        url = f"{base.rstrip('/')}/collective_rpc"
        code, text = _post_json(url, {"method": TARGET_SOLVES_RPC, "args": [int(seed), int(step)]}, timeout)
        if code != 200:
            raise RuntimeError(
                f"reading the in-engine target solves from {url} failed ({code}: {text[:300]}): the server must run "
                "with VLLM_SERVER_DEV_MODE=1 and the ncgrpo plugin in its workers"
            )
        per_worker = json.loads(text).get("results") or []
    else:
        try:
            per_worker = engine.collective_rpc(TARGET_SOLVES_RPC, args=(int(seed), int(step)))
        except Exception as e:  # in-process workers raise NotImplementedError; multiprocess ones wrap it
            if TARGET_SOLVES_RPC not in str(e):
                raise
            raise RuntimeError(
                "the ncgrpo vLLM plugin is not active in the engine's workers (no target solves to read back)"
            ) from e
    seen: dict[tuple, dict[str, Any]] = {}
    for solves in per_worker:
        for s in solves or ():
            seen.setdefault((s["prompt_id"], s["target_tv"]), dict(s))
    return [seen[k] for k in sorted(seen, key=lambda k: (k[0], k[1]))]
