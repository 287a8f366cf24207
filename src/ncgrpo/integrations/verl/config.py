"""The verl integration's pure part (imports no verl, no Ray, no vLLM): the ``ncgrpo:`` config block, the
plan of one verl session, the prompt id, the per-half and target-schedule metrics and the checks of
verl's own config.

verl runs a group of ``G = actor_rollout_ref.rollout.n`` rollouts of one prompt as ``G`` sessions
(``session_id = 0 .. G-1``) under one ``uid`` (verl 0.9.1, ``AgentLoopWorkerTQ._run_prompt``), and
its GRPO normalises rewards over the rows sharing a ``uid``. So NC-GRPO on verl is: session
``session_id`` is row ``branch = session_id`` of :func:`ncgrpo.core.plan.plan_rows` (the one row plan
every engine uses), sessions ``n .. G-1`` carry the vLLM plugin's noise spec, and verl's plain GRPO
advantage over the joint group of ``2n`` rows is Prop. 2's (``tests/integrations/test_verl.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ncgrpo.core.noise import noise_seed
from ncgrpo.core.plan import plan_rows, prompt_id_for
from ncgrpo.core.schedule import Schedule
from ncgrpo.core.sigma_solve import TARGET_DRAWS, TARGET_SCOPES
from ncgrpo.engines.vllm import EXTRA_ARGS_KEY, noise_extra_args, parse_noise_spec, target_spec
from ncgrpo.integrations.verl.metrics import VERL_EPS, half_metrics, target_metrics
from ncgrpo.methods import RolloutMethod, get_method, methods

__all__ = [
    "CONFIG_KEY",
    "VERL_EPS",
    "NCGRPOVerlConfig",
    "SessionNoise",
    "TARGET_SCOPES",
    "VERL_BATCH_TARGET_REFUSAL",
    "check_verl_config",
    "half_metrics",
    "plan_session",
    "target_metrics",
    "verl_methods",
    "verl_prompt_id",
    "with_noise",
]

#: The top-level key of verl's Hydra config that holds :class:`NCGRPOVerlConfig`.
CONFIG_KEY = "ncgrpo"


def verl_methods() -> tuple[str, ...]:
    """The registered rollout methods the verl integration runs (``verl_refusal`` None): each noisy session
    sends the vLLM plugin the spec of :meth:`~ncgrpo.methods.RolloutMethod.verl_extra_args`."""
    return tuple(m.name for m in methods() if m.verl_refusal is None)


def _get(config: Any, path: str, default: Any = None) -> Any:
    """``config.a.b.c`` or ``default`` (verl's OmegaConf DictConfig or plain dicts)."""
    node = config
    for part in path.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if getter is not None else getattr(node, part, None)
    return default if node is None else node


# --------------------------------------------------------------------------------------------------
# the `ncgrpo:` block of verl's config
# --------------------------------------------------------------------------------------------------
#: Why ``target_scope: batch`` is refused on verl (``prompt`` runs: the vLLM plugin solves each prompt's sigma).
VERL_BATCH_TARGET_REFUSAL = (
    "the batch scope holds the batch's mean TV at one shared sigma_k, which needs every prompt's branch-point "
    "state before any rollout of the batch starts; verl's agent loops run each prompt's sessions as their own "
    "asynchronous requests, spread over vLLM replicas, so no process holds the batch's states before the "
    "first rollout. Use ncgrpo.target_scope=prompt (each prompt's own sigma solved inside the vLLM engine "
    "from that prompt's clean state, so that ITS TV is the target)"
)
#: The largest noise scale (``ncgrpo.trainer.config.SIGMA0_MAX``, same check).
SIGMA0_MAX = 10.0


@dataclass(frozen=True)
class NCGRPOVerlConfig:
    """NC-GRPO's settings on verl: the top-level ``ncgrpo:`` block of verl's Hydra config.

    Field names are :class:`ncgrpo.trainer.NCGRPOConfig`'s (one name per concept). ``k`` of eq. (3) is
    verl's ``global_steps`` (1-based; one step = one rollout batch, EasyR1's and so NoisyRollout's
    unit), ``K`` is ``schedule_total_steps`` or else ``trainer.total_training_steps``.
    """

    rollout_method: str = "latent"
    """The rollout method: one of :func:`verl_methods` (the registered methods whose ``verl_refusal`` is None);
    a wrong name is refused with the list."""
    sigma0: float = 0.2
    """sigma_0 of eq. (2)/(3)."""
    sigma_schedule: str = "sigmoid"
    """eq. (3) ('sigmoid'), or 'constant' / 'linear' (ablations)."""
    schedule_gamma: float = 30.0
    """gamma of eq. (3)."""
    schedule_k_mid: float = 40.0
    """k_mid of eq. (3), in verl steps (rollout batches)."""
    schedule_total_steps: int | None = None
    """K of eq. (3); None: verl's ``trainer.total_training_steps`` (which must then be set)."""
    noise_seed: int = 1
    """The run seed of every NoiseKey."""
    first_token_temperature: float = 2.0
    """T0 of the first-token-temperature control: T_k = T + (T0 - T) * sigma_k / sigma0."""
    target_marginal_tv: float | None = None
    """Hold the noise's effect instead of its size: each noisy session asks the vLLM plugin to solve its
    prompt's sigma so that the prompt's noise-averaged first-token TV(q, q_bar) is
    ``target_marginal_tv * decay_k`` (eq. 3's decay anneals the target); ``sigma0`` is the solver's first
    guess. In (0, 1]; None (default): sigma_k = sigma0 * decay_k, the paper. Needs ``target_scope: prompt``."""
    target_scope: str = "batch"
    """``target_marginal_tv``'s scope: 'prompt' (each prompt's own sigma, solved in the vLLM engine from the
    prompt's clean branch-point state) or 'batch' (one sigma for the batch mean; refused on verl:
    :data:`VERL_BATCH_TARGET_REFUSAL`). The default is ``NCGRPOConfig``'s."""
    sigma_max: float = 2.0
    """``target_marginal_tv``: the largest sigma the solver may use, in (0, 10]; a prompt whose TV stays below
    the target there is generated at sigma_max (logged ``noise/sigma_at_max``)."""
    marginal_tv_draws: int = 64
    """``target_marginal_tv``: eps draws per prompt through the LM head behind each solve, an even number
    (antithetic pairs), at least :data:`TARGET_DRAWS`."""
    noisy_importance_sampling: str = "exclude"
    """'exclude': refuse verl settings that reweight or drop the noisy rows (rollout_is, rollout_rs,
    bypass_mode), the paper's no-density-correction; 'apply': allow them."""

    def __post_init__(self) -> None:
        try:
            method = get_method(self.rollout_method)
        except ValueError:
            raise ValueError(
                f"ncgrpo.rollout_method={self.rollout_method!r}: use one of {', '.join(verl_methods())}"
            ) from None
        if method.verl_refusal:
            raise ValueError(
                f"ncgrpo.rollout_method={self.rollout_method!r} is not supported on verl: {method.verl_refusal}"
            )
        self._check_target(method)
        if not math.isfinite(self.sigma0) or self.sigma0 < 0:
            raise ValueError(f"ncgrpo.sigma0 must be a finite number >= 0, got {self.sigma0}")
        if self.schedule_total_steps is not None and int(self.schedule_total_steps) < 1:
            raise ValueError(f"ncgrpo.schedule_total_steps must be >= 1, got {self.schedule_total_steps}")
        if self.noisy_importance_sampling not in ("exclude", "apply"):
            raise ValueError(
                f"ncgrpo.noisy_importance_sampling must be 'exclude' or 'apply', got {self.noisy_importance_sampling!r}"
            )
        if not self.first_token_temperature > 0:
            raise ValueError(
                f"ncgrpo.first_token_temperature must be > 0, got {self.first_token_temperature}"
            )
        self.schedule  # noqa: B018 - eq. (3)'s settings: ValueError naming the one to fix

    def _check_target(self, method: RolloutMethod) -> None:
        """``target_marginal_tv``: a TV in (0, 1], scope ``prompt``, a method whose noisy half is set by a sigma
        (its ``target_refusal``), ``sigma0`` > 0 (the first guess), ``sigma_max`` in (0, 10] and enough draws."""
        if self.target_scope not in TARGET_SCOPES:
            raise ValueError(f"ncgrpo.target_scope must be 'batch' or 'prompt', got {self.target_scope!r}")
        for name, v, low in (("marginal_tv_draws", self.marginal_tv_draws, 0),):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"ncgrpo.{name} must be an integer >= {low}, got {v!r}")
        sm = self.sigma_max
        if (
            isinstance(sm, bool)
            or not isinstance(sm, int | float)
            or not (math.isfinite(sm) and 0 < sm <= SIGMA0_MAX)
        ):
            raise ValueError(
                f"ncgrpo.sigma_max must be a finite number in (0, {SIGMA0_MAX:g}] (the target schedule's bound on "
                f"sigma), got {sm!r}"
            )
        t = self.target_marginal_tv
        if t is None:
            return
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and 0 < t <= 1):
            raise ValueError(
                f"ncgrpo.target_marginal_tv must be a total-variation distance in (0, 1] (or null: sigma_k = sigma0 "
                f"* decay_k), got {t!r}"
            )
        if method.target_refusal:
            raise ValueError(
                f"ncgrpo.target_marginal_tv cannot set the noise of rollout_method={method.name!r}: "
                f"{method.target_refusal}. Use one of "
                f"{', '.join(m for m in verl_methods() if not get_method(m).target_refusal)}, or unset "
                "target_marginal_tv."
            )
        if self.target_scope == "batch":
            raise ValueError(
                f"ncgrpo.target_scope='batch' is not supported on verl: {VERL_BATCH_TARGET_REFUSAL}"
            )
        if not self.sigma0 > 0:
            raise ValueError(
                f"ncgrpo.target_marginal_tv: sigma0 is the solver's first guess and must be > 0, got {self.sigma0}"
            )
        if self.sigma0 > self.sigma_max:
            raise ValueError(
                f"ncgrpo.target_marginal_tv: sigma0 {self.sigma0} (the solver's first guess) is above sigma_max "
                f"{self.sigma_max}; raise sigma_max or lower sigma0"
            )
        if self.marginal_tv_draws % 2 or self.marginal_tv_draws < TARGET_DRAWS:
            raise ValueError(
                f"ncgrpo.target_marginal_tv solves each prompt's sigma on marginal_tv_draws draws (antithetic "
                f"pairs, with a jackknife bias correction, which needs three pairs or more): an even number >= "
                f"{TARGET_DRAWS}, got {self.marginal_tv_draws} (default 64)"
            )

    @classmethod
    def from_mapping(cls, block: Mapping[str, Any] | None) -> NCGRPOVerlConfig:
        """From the ``ncgrpo:`` block (a dict or OmegaConf node); an unknown key is an error naming the nearest."""
        block = dict(block or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in block if k not in names]
        if unknown:
            hints = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            raise ValueError(
                "unknown keys in verl's `ncgrpo:` block: "
                + ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
            )
        return cls(**block)

    @classmethod
    def from_verl_config(cls, config: Any) -> NCGRPOVerlConfig:
        """From verl's whole config: the ``ncgrpo:`` block, with ``K`` resolved from the trainer section."""
        cfg = cls.from_mapping(_get(config, CONFIG_KEY, {}))
        K = cfg.schedule_total_steps or _get(config, "trainer.total_training_steps")
        if cfg.method.two_pass and cfg.sigma_schedule != "constant" and not K:
            raise ValueError(
                "eq. (3) needs K: set trainer.total_training_steps (the paper's Geometry3K run: 60) or "
                "ncgrpo.schedule_total_steps; verl derives its own total from the dataloader in the trainer "
                "process only, which the rollout workers cannot see"
            )
        return dataclasses.replace(cfg, schedule_total_steps=int(K) if K else None)

    @property
    def method(self) -> RolloutMethod:
        """The rollout method (:mod:`ncgrpo.methods`)."""
        return get_method(self.rollout_method)

    @property
    def schedule(self) -> Schedule:
        """eq. (3)'s schedule; ``k`` counts verl's steps (rollout batches)."""
        return Schedule.from_args(self, unit="generation")

    def sigma_at(self, step: int) -> float:
        """sigma_k of eq. (3) at verl step ``k = step``."""
        return self.schedule.sigma(int(step), int(self.schedule_total_steps or 1), self.sigma0)

    def target_at(self, step: int) -> float:
        """The annealed target TV at verl step ``k = step``: ``target_marginal_tv * decay_k`` (eq. 3's decay);
        ``target_marginal_tv`` must be set."""
        if self.target_marginal_tv is None:
            raise ValueError("ncgrpo.target_marginal_tv is not set")
        return self.schedule.target(int(step), int(self.schedule_total_steps or 1), self.target_marginal_tv)

    def target_spec(self, step: int, temperature: float) -> dict[str, Any]:
        """The vLLM plugin's ``"target"`` of one noisy session at verl step ``step``
        (:func:`ncgrpo.engines.vllm.target_spec`): the annealed TV, the draws, the rollout temperature, the
        solver's first guess (sigma0) and bound, the method's noise mode."""
        if not temperature > 0:
            raise ValueError(
                "ncgrpo.target_marginal_tv needs actor_rollout_ref.rollout.temperature > 0 (the TV is the one of "
                f"the sampling distribution at that temperature), got {temperature}"
            )
        return target_spec(
            self.target_at(step),
            draws=int(self.marginal_tv_draws),
            temperature=float(temperature),
            start=float(self.sigma0),
            sigma_max=float(self.sigma_max),
            mode=self.method.noise_mode or "independent",
        )

    def first_token_temperature_at(self, step: int, temperature: float) -> float:
        """The control's first-token temperature ``T + (T0 - T) * decay_k`` (eq. 3's decay)."""
        return self.schedule.temperature(
            int(step), int(self.schedule_total_steps or 1), temperature, self.first_token_temperature
        )


# --------------------------------------------------------------------------------------------------
# one verl session: the plan of its rollout row
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionNoise:
    """What one verl session (one rollout of a group) sends to vLLM.

    ``extra_args`` is ``SamplingParams.extra_args`` for the session's FIRST request (``{}``: clean);
    later turns of a multi-turn session are clean (the paper perturbs only the branch point, the
    first generated token). ``sigma`` is sigma_k on noisy rows of the hidden-noise methods, else 0
    (NaN on noisy rows under ``target_marginal_tv``: the vLLM plugin solves it per prompt).
    """

    step: int
    branch: int = 0
    noisy: bool = False
    sigma: float = 0.0
    extra_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    target: float | None = None
    """``target_marginal_tv``: the annealed target TV this noisy session asks the plugin to hold (its
    ``sigma`` is then NaN: the engine solves it; the trainer reads it back), else None."""

    def provenance(self) -> dict[str, Any]:
        """The row's record in verl's ``extra_fields["ncgrpo"]`` (read back by the trainer's metrics)."""
        spec = self.extra_args.get(EXTRA_ARGS_KEY) or {}
        return {
            "step": int(self.step),
            "branch": int(self.branch),
            "noisy": bool(self.noisy),
            "sigma": float(self.sigma),
            "target": self.target,
            "prompt_id": spec.get("prompt_id"),
            "draw": spec.get("draw"),
            "sign": spec.get("sign"),
            "logit_scale": spec.get("logit_scale"),
        }


def plan_session(
    cfg: NCGRPOVerlConfig,
    *,
    step: int,
    prompt_id: int,
    session_id: int,
    group_size: int,
    temperature: float = 1.0,
    validate: bool = False,
) -> SessionNoise:
    """The noise of session ``session_id`` of a group of ``group_size`` sessions at verl step ``step``.

    The session is row ``branch = session_id`` of :func:`ncgrpo.core.plan.plan_rows` for one prompt:
    ``NoiseKey(noise_seed, step, prompt_id, draw)`` on the noisy half (``branch >= G/2``), antithetic
    pairs sharing a draw with opposite signs. The key depends only on these numbers, so every
    agent-loop worker, vLLM replica and tensor-parallel rank computes the same one. Validation is
    clean (the paper's evaluation is noise-free).
    """
    step = int(step)
    method = cfg.method
    if validate or not method.two_pass:
        return SessionNoise(step, int(session_id))
    G = int(group_size)
    if not 0 <= int(session_id) < G:
        raise ValueError(f"session_id {session_id} outside the group of {G} sessions")
    (p,) = plan_rows(
        [int(session_id)],
        [int(prompt_id)],
        num_generations=G,
        method=method,
        seed=cfg.noise_seed,
        step=step,
    )
    if not p.noisy:
        return SessionNoise(step, p.branch)
    if cfg.target_marginal_tv is not None:
        tv = cfg.target_at(step)
        if (
            not tv > 0
        ):  # the target annealed away: sigma_k 0, the plugin leaves the row exact (as TRL's trainer)
            return SessionNoise(
                step, p.branch, True, 0.0, noise_extra_args(method.row_noise(p, 0.0)), target=0.0
            )
        # target_scope prompt: the plugin solves this prompt's sigma in the engine from its clean branch-point
        # state; every session of the prompt at this step (same seed, step, prompt_id) gets the same sigma
        extra_args = noise_extra_args(method.row_noise(p, 0.0))
        extra_args[EXTRA_ARGS_KEY]["target"] = cfg.target_spec(step, temperature)
        parse_noise_spec(extra_args)  # validated here, not in a worker
        return SessionNoise(step, p.branch, True, math.nan, extra_args, target=tv)
    sigma, extra_args = method.verl_extra_args(cfg, p, step, temperature)
    return SessionNoise(step, p.branch, True, sigma, extra_args)


def with_noise(sampling_params: Mapping[str, Any], extra_args: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of verl's sampling-params dict with ``extra_args`` merged in (the caller's dict, which a
    multi-turn loop reuses every turn, is left alone). verl's server builds ``SamplingParams(**d)``."""
    out = dict(sampling_params)
    if extra_args:
        merged = dict(out.get("extra_args") or {})
        merged.update(extra_args)
        out["extra_args"] = merged
    return out


# --------------------------------------------------------------------------------------------------
# the prompt id: a stable 63-bit integer naming the prompt's noise streams
# --------------------------------------------------------------------------------------------------
def _feed(h: Any, obj: Any) -> None:
    """A canonical byte stream of a prompt's content (messages, text, image pixels) into ``h``."""
    if obj is None:
        h.update(b"N")
    elif isinstance(obj, str):
        b = obj.encode()
        h.update(b"s" + struct.pack("<Q", len(b)) + b)
    elif isinstance(obj, bytes | bytearray | memoryview):
        b = bytes(obj)
        h.update(b"b" + struct.pack("<Q", len(b)) + b)
    elif isinstance(obj, bool | int | float):
        h.update(b"n" + repr(obj).encode())
    elif isinstance(obj, Mapping):
        h.update(b"{")
        for k in sorted(obj, key=str):
            _feed(h, str(k))
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, torch.Tensor):
        _feed(h, obj.detach().cpu().numpy())
    elif hasattr(obj, "tobytes") and hasattr(obj, "mode") and hasattr(obj, "size"):  # a PIL image: its pixels
        h.update(b"i" + f"{obj.mode}:{obj.size}".encode())
        h.update(obj.tobytes())
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype") and getattr(obj.dtype, "kind", "O") != "O":
        h.update(b"a" + f"{obj.dtype}:{obj.shape}".encode())  # a numeric numpy array
        h.update(obj.tobytes())
    elif isinstance(obj, Sequence) or hasattr(obj, "tolist"):  # lists, tuples, object arrays
        h.update(b"[")
        for item in obj.tolist() if hasattr(obj, "tolist") else obj:
            _feed(h, item)
        h.update(b"]")
    else:
        h.update(b"r" + repr(obj).encode())


def verl_prompt_id(prompt: Mapping[str, Any]) -> int:
    """The stable 63-bit id of one verl prompt (a row of the agent loop's batch).

    ``extra_info["question_id"]`` when the dataset has one (:func:`ncgrpo.core.plan.prompt_id_for`, as
    the TRL trainer hashes its ``question_id`` column); otherwise a hash of the prompt's content:
    ``raw_prompt`` (the chat messages, image pixels included: Geometry3K has many identical question
    texts with different figures) and the ``images`` / ``videos`` columns when present. Not ``uid``
    (a fresh uuid4 per batch) and not ``index`` (0 for every row of a dataset without
    ``extra_info.index``). Independent of worker, process, batch layout and Python's hash seed.
    """
    extra = prompt.get("extra_info")
    if isinstance(extra, Mapping) and extra.get("question_id") is not None:
        return prompt_id_for(question_id=extra["question_id"])
    if prompt.get("raw_prompt") is None:
        raise ValueError(
            "a verl prompt needs `raw_prompt` (or extra_info.question_id) to name its noise streams"
        )
    h = hashlib.blake2b(digest_size=16)
    for key in ("raw_prompt", "images", "videos"):
        if prompt.get(key) is not None:
            _feed(h, key)
            _feed(h, prompt[key])
    return noise_seed("verl_prompt", h.hexdigest())


# --------------------------------------------------------------------------------------------------
# verl's own settings that NC-GRPO depends on
# --------------------------------------------------------------------------------------------------
def check_verl_config(config: Any, cfg: NCGRPOVerlConfig | None = None) -> None:
    """Refuse verl settings under which NC-GRPO would silently not be NC-GRPO, saying what to change.

    - ``trainer.use_v1`` (the agent-loop worker is the v1 trainer's) and ``trainer.v1.trainer_mode=sync``:
      the async modes resume an interrupted request as prompt + partial response, whose first sampled
      token (mid-response) the plugin would perturb again.
    - ``actor_rollout_ref.rollout.name=vllm`` (the plugin is vLLM's).
    - ``rollout.n`` even (``n`` clean + ``n`` noisy), a multiple of 4 for antithetic pairs.
    - ``algorithm.adv_estimator`` ``grpo`` (or ``grpo_vectorized``): the joint-group advantage of Prop. 2.
    - rollout correction: ``algorithm.rollout_correction.rollout_is`` / ``rollout_rs`` would reweight or
      drop the noisy rows (their first token was sampled from perturbed logits, so the rollout/trainer
      ratio there is far from 1) and ``bypass_mode`` would use those perturbed rollout log-probs as the
      PPO anchor; the paper applies no density correction (section 3.1). Refused unless
      ``ncgrpo.noisy_importance_sampling=apply``.
    """
    cfg = cfg or NCGRPOVerlConfig.from_verl_config(config)
    method = cfg.method
    if not method.two_pass:
        return
    problems = []
    if not _get(config, "trainer.use_v1", False):
        problems.append(
            "trainer.use_v1 must be true (the NC-GRPO agent-loop worker extends verl's v1 AgentLoopWorkerTQ)"
        )
    mode = _get(config, "trainer.v1.trainer_mode", "sync")
    if mode != "sync":
        problems.append(
            f"trainer.v1.trainer_mode={mode!r}: only 'sync'. The async modes resume interrupted requests as prompt + "
            "partial response, and the plugin would perturb that resumed request's first token, mid-response"
        )
    name = _get(config, "actor_rollout_ref.rollout.name")
    if name != "vllm":
        problems.append(
            f"actor_rollout_ref.rollout.name={name!r}: the NC-GRPO noise is a vLLM plugin; use vllm"
        )
    n = int(_get(config, "actor_rollout_ref.rollout.n", 1))
    try:
        method.check_group_size(n, field="actor_rollout_ref.rollout.n")
    except ValueError as e:
        problems.append(f"{e} (G = n clean + n noisy rollouts)")
    est = str(_get(config, "algorithm.adv_estimator", "grpo"))
    if est not in ("grpo", "grpo_vectorized"):
        problems.append(
            f"algorithm.adv_estimator={est!r}: NC-GRPO's contrast lives in GRPO's joint-group normalisation "
            "(Prop. 2); use grpo"
        )
    if cfg.noisy_importance_sampling == "exclude":
        rc = _get(config, "algorithm.rollout_correction", {}) or {}
        for key in ("rollout_is", "rollout_rs"):
            if _get(rc, key) is not None:
                problems.append(
                    f"algorithm.rollout_correction.{key}={_get(rc, key)!r} would reweight or drop the noisy rows (their "
                    "first token comes from perturbed logits); set it to null, or ncgrpo.noisy_importance_sampling=apply"
                )
        if _get(rc, "bypass_mode", False):
            problems.append(
                "algorithm.rollout_correction.bypass_mode=true uses the rollout log-probs (perturbed on the noisy rows' "
                "first token) as the PPO anchor; set it to false (old log-probs recomputed clean), or "
                "ncgrpo.noisy_importance_sampling=apply"
            )
        if _get(config, "actor_rollout_ref.actor.policy_loss.loss_mode") == "bypass_mode":
            problems.append(
                "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode: same as bypass_mode above"
            )
    temperature = float(_get(config, "actor_rollout_ref.rollout.temperature", 1.0))
    if method.needs_sampling_temperature and not temperature > 0:
        problems.append(f"rollout_method={method.name!r} needs actor_rollout_ref.rollout.temperature > 0")
    tp = int(_get(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1) or 1)
    if cfg.target_marginal_tv is not None and tp > 1:
        problems.append(
            f"ncgrpo.target_marginal_tv with actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: the vLLM "
            "plugin solves each prompt's sigma through the whole LM head on one worker, and vLLM's ParallelLMHead "
            "shards its vocabulary rows across tensor-parallel ranks (ncgrpo.engines.vllm.target_solve_problem); "
            "use tensor_model_parallel_size=1 (more replicas instead) or unset target_marginal_tv"
        )
    if cfg.target_marginal_tv is not None and not temperature > 0:
        problems.append(
            "ncgrpo.target_marginal_tv needs actor_rollout_ref.rollout.temperature > 0: the TV it holds is the one "
            "of the first-token sampling distribution at that temperature"
        )
    if problems:
        raise ValueError("NC-GRPO cannot run with this verl config:\n- " + "\n- ".join(problems))
