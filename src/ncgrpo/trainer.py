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
   the noisy half (``branch - n``; an antithetic pair's index for paired methods, as
   :func:`ncgrpo.rollout.plan_group`): a resumed run, a different
   process count or a different batch layout draws exactly the same noise for the same rollout.
4. Advantages are TRL's joint ``(r - mean) / (std + 1e-4)`` over the whole 2n group (the paper and
   NoisyRollout), except ``antithetic_grouping="separate"`` (see :func:`plan_rows`).
5. No density correction for the noisy half (section 3.1). TRL 1.16 only corrects the
   sampler/trainer mismatch on its vLLM path (``vllm_importance_sampling_correction``); there
   ``noisy_importance_sampling="exclude"`` forces the noisy rows' ratio to 1 (they would otherwise be
   masked or down-weighted as "mismatched"), ``"apply"`` keeps TRL's behaviour for every row
   (:func:`apply_noisy_importance_sampling`). The vLLM engine hook is not part of this module yet:
   hidden-noise methods refuse ``use_vllm=True``; :func:`plan_rows`, :func:`prompt_id_for` and
   :func:`row_noise` are engine-free so the vLLM path can reuse them unchanged.

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
- ``first_token_temperature``: the matched control: the noisy half gets no hidden noise but samples
  its first token at ``first_token_temperature`` (not annealed).

Logged (TRL ``_metrics``; all gathered over processes): ``noise/sigma_k``, ``reward/clean``,
``reward/noisy``, ``reward/contrast``, ``noise/rel_perturbation``, ``noise/first_token_divergence``
(and ``noise/first_token_divergence_clean``, the same rate on the clean half: its baseline under
temperature sampling), ``noise/agreement``, ``spsa/mu_norm``, ``image_noise/t``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from trl import GRPOConfig, GRPOTrainer

from ncgrpo import noise as nz
from ncgrpo.advantages import contrast_statistic, group_advantages
from ncgrpo.inert import InertNoiseMonitor, InertNoiseWarning
from ncgrpo.noise import NoiseKey, RowNoise
from ncgrpo.prefix import branch_prefix_scope, prefix_completions

__all__ = [
    "HIDDEN_NOISE_METHODS",
    "ROLLOUT_METHODS",
    "TWO_PASS_METHODS",
    "NCGRPOConfig",
    "NCGRPOTrainer",
    "RowPlan",
    "StepRecord",
    "apply_noisy_importance_sampling",
    "parse_noise_site",
    "plan_rows",
    "prompt_id_for",
    "row_noise",
]

ROLLOUT_METHODS = ("vanilla", "latent", "image", "antithetic", "spsa", "first_token_temperature")
TWO_PASS_METHODS = frozenset(ROLLOUT_METHODS) - {"vanilla"}
HIDDEN_NOISE_METHODS = frozenset({"latent", "antithetic", "spsa"})
PAIRED_METHODS = frozenset({"antithetic", "spsa"})
STATE_FILE = "ncgrpo_state.pt"


# ==================================================================================================
# Config
# ==================================================================================================
def parse_noise_site(site: str | int | Sequence[int]) -> str | list[int]:
    """``"final_norm"`` -> ``"final_norm"``; ``"12"`` / ``"10,14"`` (or ints) -> sorted layer list."""
    if isinstance(site, int):
        site = str(site)
    if not isinstance(site, str):
        site = ",".join(str(int(s)) for s in site)
    s = site.strip()
    if s == "final_norm":
        return "final_norm"
    try:
        layers = [int(p) for p in s.split(",")]
    except ValueError:
        raise ValueError(
            f"noise_site={site!r} is not understood: use 'final_norm' (the paper's site) or comma-separated "
            "decoder-layer indices such as '12' or '10,14' (the propagating variant)"
        ) from None
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"noise_site={site!r}: layer indices must be distinct and >= 0")
    return sorted(layers)


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
            "a learned steering vector, eq. 6) or 'first_token_temperature' (matched control)."
        },
    )
    sigma0: float = field(
        default=0.2,
        metadata={"help": "Initial noise scale sigma_0 of eq. (2)/(3) (latent/antithetic/spsa); >= 0."},
    )
    sigma_schedule: str = field(
        default="sigmoid",
        metadata={
            "help": "Annealing of sigma_k and of the image method's t: 'sigmoid' (eq. 3), 'constant', 'linear'."
        },
    )
    schedule_gamma: float = field(default=30.0, metadata={"help": "gamma of eq. (3)."})
    schedule_k_mid: float = field(default=40.0, metadata={"help": "k_mid of eq. (3), in optimizer steps."})
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
    first_token_temperature: float = field(
        default=2.0,
        metadata={
            "help": "Temperature of the noisy half's first token (rollout_method='first_token_temperature')."
        },
    )
    image_noise_step: int = field(
        default=500,
        metadata={
            "help": "NoisyRollout's alpha_0 (gaussian_noise_step): the image method distorts at "
            "t = int(image_noise_step * decay_k), 0 <= t < 1000."
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
        if self.spsa_lr < 0 or self.spsa_mu_max < 0:
            raise ValueError(f"spsa_lr and spsa_mu_max must be >= 0, got {self.spsa_lr}, {self.spsa_mu_max}")
        if not self.first_token_temperature > 0:
            raise ValueError(f"first_token_temperature must be > 0, got {self.first_token_temperature}")
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

    @property
    def noise_site_parsed(self) -> str | list[int]:
        return parse_noise_site(self.noise_site)


# ==================================================================================================
# Engine-free planning (shared with the vLLM path)
# ==================================================================================================
@dataclass(frozen=True)
class RowPlan:
    """What one rollout row of the global generation batch is.

    ``group`` is TRL's group (``global_row // G``); ``branch = global_row % G``; ``noisy`` iff
    ``branch >= n``. ``key`` names the row's noise draw (``None`` on clean rows and for the
    first-token-temperature control); ``sign`` is ``-1`` for the second member of an antithetic pair
    (which reuses its partner's key). ``adv_group`` is the advantage group the row is normalised in.
    """

    global_row: int
    group: int
    branch: int
    noisy: bool
    prompt_id: int
    key: NoiseKey | None = None
    sign: float = 1.0
    adv_group: int = 0

    def as_tuple(self) -> tuple:
        k = self.key
        return (
            self.global_row,
            self.branch,
            self.noisy,
            self.sign,
            None if k is None else (k.seed, k.step, k.prompt_id, k.branch),
            self.adv_group,
        )


def prompt_id_for(
    question_id: Any = None, token_ids: Sequence[int] | None = None, images: Sequence[Any] | None = None
) -> int:
    """A stable 63-bit id naming a prompt: a hash of the ``question_id`` column when the dataset has one,
    else :func:`ncgrpo.rollout.prompt_hash` of the prompt's token ids and image pixels (the id
    ``generate_groups`` uses). Independent of batch layout, process and Python's hash seed."""
    if question_id is not None:
        return nz.noise_seed("question_id", str(question_id))
    if token_ids is None:
        raise ValueError("prompt_id_for needs a question_id or the prompt's token ids")
    from ncgrpo.rollout import prompt_hash

    return prompt_hash(list(token_ids), [im for im in (images or []) if im is not None])


def plan_rows(
    global_rows: Sequence[int],
    prompt_ids: Sequence[int],
    *,
    num_generations: int,
    method: str,
    seed: int,
    step: int,
    antithetic_grouping: str = "joint",
) -> list[RowPlan]:
    """Plan the rows ``global_rows`` (indices into the global generation batch) for step ``step``.

    Engine-free and deterministic: a row's plan depends only on its global index, its prompt id and
    (seed, step) -- never on which process or engine holds it. ``branch = global_row % G``; the
    noisy half is ``branch >= n``, and its ``j = branch - n``-th row draws as
    :func:`ncgrpo.rollout.plan_group` lays a group out (keys index the draw within the noisy half,
    as :class:`~ncgrpo.noise.NoiseKey` documents), so the trainer and ``generate_groups`` agree:

    - clean rows: no key.
    - ``latent``: ``key = NoiseKey(seed, step, prompt_id, j)``.
    - ``antithetic`` / ``spsa``: pairs ``[+0, -0, +1, -1, ...]``: row ``j`` uses
      ``NoiseKey(seed, step, prompt_id, j // 2)`` with ``sign = +1`` for even ``j``, ``-1`` for odd.
    - ``image``: every noisy row of a prompt carries ``NoiseKey(seed, step, prompt_id, 0)``: one
      distorted image per prompt, shared by its noisy half (NoisyRollout;
      :func:`ncgrpo.image_noise.prompt_image_seed`).
    - ``first_token_temperature``: noisy rows carry no key.

    ``adv_group`` is ``group`` except for ``antithetic_grouping="separate"`` (paired methods), which
    splits each 2n group into two advantage groups of n rows: group ``2*group`` holds clean branches
    ``0 .. n/2-1`` and the ``+`` pair members, group ``2*group + 1`` clean branches ``n/2 .. n-1``
    and the ``-`` members. Each keeps a 50/50 clean/noisy mix (so Prop. 2's contrast is still
    there) and no ``(+eps, -eps)`` pair shares a baseline: the group mean no longer averages the pair
    into its even part, the cancellation Lemma 1 describes for the joint group.
    """
    G = num_generations
    if method not in ROLLOUT_METHODS:
        raise ValueError(f"unknown rollout method {method!r}")
    if len(global_rows) != len(prompt_ids):
        raise ValueError("one prompt id per row")
    n = G // 2
    out = []
    for row, pid in zip(global_rows, prompt_ids, strict=True):
        row, pid = int(row), int(pid)
        group, branch = divmod(row, G)
        noisy = method in TWO_PASS_METHODS and branch >= n
        key, sign, adv_group = None, 1.0, group
        if noisy:
            j = branch - n
            if method == "latent":
                key = NoiseKey(seed, step, pid, j)
            elif method in PAIRED_METHODS:
                key = NoiseKey(seed, step, pid, j // 2)
                sign = 1.0 if j % 2 == 0 else -1.0
            elif method == "image":
                key = NoiseKey(seed, step, pid, 0)
        if method in PAIRED_METHODS and antithetic_grouping == "separate":
            first = (branch < n // 2) if not noisy else (sign > 0)
            adv_group = 2 * group + (0 if first else 1)
        out.append(RowPlan(row, group, branch, noisy, pid, key, sign, adv_group))
    return out


def row_noise(plan: RowPlan, sigma: float, method: str) -> RowNoise:
    """The hidden-state instruction for one row (clean unless the method injects hidden noise)."""
    if method not in HIDDEN_NOISE_METHODS or not plan.noisy or plan.key is None:
        return RowNoise()
    mode = {"latent": "independent", "antithetic": "antithetic", "spsa": "rank_one"}[method]
    return RowNoise(sigma=float(sigma), key=plan.key, sign=plan.sign, mode=mode)


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
def _safetensors_files(checkpoint: str) -> list[str]:
    """The model weight files of a Trainer checkpoint (single file or sharded index); [] if none."""
    import json

    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(checkpoint, s) for s in shards]
    return []


@dataclass
class StepRecord:
    """What NC-GRPO did at one generation (kept in ``trainer.nc_history``; identical on every rank).

    ``rows``: the global plan (:meth:`RowPlan.as_tuple` per global row); ``local_rows``: the plan this
    rank's hook applied (its slice of ``rows``); ``rewards`` / ``advantages``: the global weighted
    rewards and the advantages TRL trains on; ``rel``: the measured relative perturbation per global
    row (0 on clean rows), all in global row order.
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
    image_t: int | None = None
    rel: torch.Tensor | None = None  # [L]
    branch_state: torch.Tensor | None = (
        None  # [L, d] final state at the last prompt token (what the logits see)
    )
    branch_argmax: torch.Tensor | None = None  # [L] argmax of the logits at the branch point
    first_token: torch.Tensor | None = None  # [L]
    gen_pixel_values: torch.Tensor | None = None  # what generate saw (image method; for tests)


class NCGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with NC-GRPO's rollout methods (see the module docstring for each).

    Only the generation seam changes. Importance sampling: TRL 1.16 corrects the sampler/trainer
    mismatch only on its vLLM path; with ``noisy_importance_sampling="exclude"`` (default) the noisy
    rows' ratio is forced to 1 (the paper applies no density correction to the perturbed half),
    ``"apply"`` keeps TRL's ratio for every row. ``nc_history`` holds one :class:`StepRecord` per
    generation; ``spsa_mu`` the steering vector (``spsa`` only).
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
        self._nc_inputs: list[dict] | None = None
        self._nc_gen: _LocalGen | None = None
        self._nc_rewards_per_func: torch.Tensor | None = None
        # branch_prefix / inert-noise warning (ncgrpo.prefix, ncgrpo.inert)
        self._inert = InertNoiseMonitor(site=str(args.noise_site), branch_prefix=args.branch_prefix)
        if self.method == "vanilla":
            return
        unsupported = {
            "use_vllm": self.use_vllm,
            "use_transformers_continuous_batching": self.use_transformers_continuous_batching,
            "rollout_func": self.rollout_func is not None,
            "tools": bool(self.tools),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(
                f"rollout_method={self.method!r} runs on TRL's transformers generate path only; unset {bad}. "
                "(The vLLM engine hook is future work: plan_rows / prompt_id_for / row_noise are engine-free for it.)"
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

    # -- small helpers ---------------------------------------------------------------------------
    @property
    def noise_base_seed(self) -> int:
        return int(self.args.noise_seed if self.args.noise_seed is not None else self.args.seed)

    def _hidden_size(self) -> int:
        cfg = self.accelerator.unwrap_model(self.model).config
        return int(cfg.get_text_config().hidden_size)

    def _schedule(self, k: int, K: int, scale: float) -> float:
        a = self.args
        return nz.sigma_schedule(
            k, K, scale, kind=a.sigma_schedule, gamma=a.schedule_gamma, k_mid=a.schedule_k_mid
        )

    def image_noise_t(self, k: int, K: int) -> int:
        """NoisyRollout's diffusion step at optimizer step ``k``: ``int(image_noise_step * decay_k)``."""
        from ncgrpo.image_noise import image_noise_t

        a = self.args
        return image_noise_t(
            k, K, a.image_noise_step, kind=a.sigma_schedule, gamma=a.schedule_gamma, k_mid=a.schedule_k_mid
        )

    # -- generation seam -------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        with branch_prefix_scope(self, self.args.branch_prefix):
            return self._nc_generate_and_score_completions(inputs)

    def _nc_generate_and_score_completions(self, inputs):
        if not self.model.training or self.method == "vanilla":
            return super()._generate_and_score_completions(inputs)
        self._nc_inputs = inputs
        self._nc_gen = None
        self._nc_rewards_per_func = None
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
            self._nc_rewards_per_func = rewards_per_func  # [N_global, n_funcs], gathered by TRL
        return rewards_per_func

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if self._nc_inputs is None or self._nc_gen is not None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        from ncgrpo.engines.controls import first_token_temperature
        from ncgrpo.engines.transformers import find_text_stack, prefill_noise

        a = self.args
        k = int(self.state.global_step) + 1
        K = max(int(self.state.max_steps), 1)
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
            step=k,
            antithetic_grouping=a.antithetic_grouping,
        )
        sigma_k = self._schedule(k, K, a.sigma0) if self.method in HIDDEN_NOISE_METHODS else 0.0
        gen = _LocalGen(step=k, total_steps=K, sigma_k=sigma_k, plans=plans)
        rows = [row_noise(p, sigma_k, self.method) for p in plans]
        if self.method == "image":
            gen.image_t = self.image_noise_t(k, K)
            multimodal_fields = self._distort_images(images, multimodal_fields, plans, gen.image_t)
            gen.gen_pixel_values = multimodal_fields.get("pixel_values")
        model = self.accelerator.unwrap_model(self.model)
        # argmax of the prefill logits (the branch point's preferred first token), read inside the
        # forward so it also works where weights are only gathered during generate (ZeRO-3)
        prefill_argmax: list[torch.Tensor] = []

        def _capture(module, args, output):
            if not prefill_argmax:
                prefill_argmax.append(output[:, -1].argmax(-1).cpu())

        with ExitStack() as stack:
            handle = find_text_stack(model)[0].lm_head.register_forward_hook(_capture)
            stack.callback(handle.remove)
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
            if self.method == "first_token_temperature":
                stack.enter_context(
                    first_token_temperature(
                        model,
                        [p.noisy for p in plans],
                        temperature=self.temperature,
                        first_token_temperature=a.first_token_temperature,
                    )
                )
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if hook.records:
            rec = hook.records[0]  # the prefill
            gen.rel = rec.rel.float()
            gen.branch_state = rec.final_last.float()
            gen.branch_argmax = prefill_argmax[0] if prefill_argmax else None
        gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
        self._nc_gen = gen
        return completion_ids, logprobs

    def _distort_images(self, images, multimodal_fields, plans: list[RowPlan], t: int) -> dict:
        """Replace the noisy rows' ``pixel_values`` (generation only) by NoisyRollout-distorted copies."""
        from ncgrpo.image_noise import diffuse_images, prompt_image_seed

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
                    proc = self.processing_class.image_processor(
                        images=diffuse_images(row_imgs, t, seed), return_tensors="pt"
                    )
                    new_grid = torch.as_tensor(np.array(proc["image_grid_thw"]))
                    if not torch.equal(new_grid.cpu(), grid[img_idx : img_idx + len(row_imgs)].cpu()):
                        raise RuntimeError(
                            "distorted images changed the patch grid; the image processor must keep sizes"
                        )
                    done[p.prompt_id] = torch.as_tensor(np.array(proc["pixel_values"])).to(new_pv.dtype)
                new_pv[lo:hi] = done[p.prompt_id]
            img_idx += len(row_imgs)
        out = dict(multimodal_fields)
        out["pixel_values"] = new_pv
        return out

    # -- after rewards: regrouping, IS policy, metrics, SPSA ---------------------------------------
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
            logged = self._logs["advantages"]
            n_log = min(len(logged), adv.numel())
            for j in range(n_log):  # TRL appended the joint advantages of this batch last
                logged[len(logged) - n_log + j] = float(adv[adv.numel() - n_log + j])
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
        if self.method in HIDDEN_NOISE_METHODS:
            metrics["noise/sigma_k"] = gen.sigma_k
            metrics["noise/rel_perturbation"] = float(rel[noisy].mean())
        if self.method == "image":
            metrics["image_noise/t"] = float(gen.image_t)
        if gen.branch_state is not None and gen.branch_argmax is not None:
            argmax = self._gather(gen.branch_argmax)
            first = self._gather(gen.first_token)
            states = self._gather(gen.branch_state)  # [N, d]
            clean_argmax = argmax.view(B, G)[:, ~noisy_mask_g][:, 0]  # [B] clean branch point's argmax
            differs = first.view(B, G) != clean_argmax[:, None]  # [B, G]
            metrics["noise/first_token_divergence"] = float(differs[:, noisy_mask_g].float().mean())
            metrics["noise/first_token_divergence_clean"] = float(differs[:, ~noisy_mask_g].float().mean())
            sg = states.view(B, G, -1)
            agree = []
            for b in range(B):
                kern = nz.agreement_kernel(sg[b])
                agree.append(kern[~torch.eye(G, dtype=torch.bool)].mean())
            metrics["noise/agreement"] = float(torch.stack(agree).mean())
        mu_norm = None
        if self.method == "spsa":
            mu_norm = float(torch.linalg.vector_norm(self.spsa_mu))
            metrics["spsa/mu_norm"] = mu_norm
            self._spsa_step(plans, rewards, gen.sigma_k, gen.step)

        inert = self._inert.update(gen.step, gen.sigma_k, metrics.get("noise/first_token_divergence"))
        if inert is not None and self.accelerator.is_main_process:
            warnings.warn(inert, InertNoiseWarning, stacklevel=2)
        mode = "train"
        for name, v in metrics.items():
            self._metrics[mode][name].append(v)
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

    def _spsa_step(self, plans: list[RowPlan], rewards: torch.Tensor, sigma_k: float, k: int) -> None:
        """eq. (6): ``mu <- Pi(mu + eta * g)`` from the antithetic reward gaps of this step.

        Pair ``p``'s branch-point displacement is ``sigma_k * r_p * u_k`` (+ the shared ``mu``), with
        ``r_p`` the rank-one scalar of its key at the last prompt token, so its gap is weighted by
        ``r_p`` (``spsa_gradient(..., r=...)``); NaN-reward pairs are dropped. Every rank runs this on
        the same gathered rewards, so ``mu`` stays identical across processes.
        """
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
            return
        g = nz.spsa_gradient(rp, rm, sigma_k, u, r=r)
        self.spsa_mu = nz.spsa_update(self.spsa_mu, g, self.args.spsa_lr, self.args.spsa_mu_max).float()

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.method != "vanilla" and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            out = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            torch.save(
                {
                    "rollout_method": self.method,
                    "global_step": self.state.global_step,
                    "spsa_mu": self.spsa_mu,
                },
                os.path.join(out, STATE_FILE),
            )

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
        files = _safetensors_files(resume_from_checkpoint)
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
        if checkpoint is None or self.method != "spsa":
            return
        path = os.path.join(checkpoint, STATE_FILE)
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
