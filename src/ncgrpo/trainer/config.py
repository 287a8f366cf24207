"""``NCGRPOConfig``: ``GRPOConfig`` plus NC-GRPO's settings, checked in ``__post_init__``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from trl import GRPOConfig

from ncgrpo.core.noise import parse_noise_site
from ncgrpo.core.schedule import Schedule
from ncgrpo.core.sigma_solve import TARGET_DRAWS, TARGET_SCOPES
from ncgrpo.methods import get_method, method_help, methods

#: The largest noise scale ``sigma0`` the method can use. eq. (2) draws ``delta = sigma ||h|| eps / sqrt(d)``,
#: so ``||delta|| ~ sigma ||h||``: sigma is the noise's size relative to the state, and the perturbed state
#: keeps a cosine of ``1 / sqrt(1 + sigma^2)`` with the clean one, 0.1 at sigma 10. Above that the noisy half
#: decodes from noise, not from the prompt (the paper uses 0.2 to 0.5; the tiny test models need up to 8 for
#: a visible effect), and far above it the float32/bf16 states overflow (3e38 ended in an internal error).
SIGMA0_MAX = 10.0


def sigma0_problem(value: object, *, bound: str | None = None) -> str | None:
    """Why ``value`` is not a noise scale ``sigma0`` in [0, :data:`SIGMA0_MAX`] (None: it is one).
    ``bound``: the value is a bound on the noise scale (``sigma_max``), which must be above 0; the text
    says what it bounds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and (value > 0 if bound else value >= 0))
    ):
        if bound:
            return f"must be a finite number > 0 ({bound}), got {value!r}"
        return f"must be a finite number >= 0 (0 disables the noise), got {value!r}"
    if value > SIGMA0_MAX:
        return (
            f"must be at most {SIGMA0_MAX:g}, got {value!r}: it is the noise's size relative to the state (eq. 2, "
            f"||delta|| ~ sigma0 ||h||), so at {SIGMA0_MAX:g} the perturbed state keeps a cosine of ~0.1 with the "
            "clean one and above it the noisy rollouts decode from noise, not from the prompt (the paper uses "
            "0.2 to 0.5)"
        )
    return None


#: numpy's seed range, which ``transformers.set_seed`` (``np.random.seed``) accepts.
_SEED_MAX = 2**32 - 1


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def _caller_stacklevel() -> int:
    """``stacklevel`` for a warning raised inside ``NCGRPOConfig(...)`` that names the line that built the
    config, not the dataclass's generated ``__init__`` (``<string>``) or TRL's / transformers' /
    ncgrpo's own frames (the command line's parser is one)."""
    import sys
    from pathlib import Path

    inside = tuple(
        str(Path(m.__file__).resolve().parent) for m in (sys.modules["ncgrpo"], sys.modules["trl"])
    )
    level, frame = 1, sys._getframe(1)  # level 1: the function that calls warnings.warn
    while frame is not None:
        name = frame.f_code.co_filename
        generated = name.startswith("<") and frame.f_code.co_name == "__init__"  # the dataclass's __init__
        if not (generated or name.startswith(inside) or "/transformers/" in name or "dataclasses" in name):
            return level
        frame, level = frame.f_back, level + 1
    return 1


@dataclass
class NCGRPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus NC-GRPO's rollout fields (one name per concept: field == CLI key == docs).

    Two-pass methods split each group of ``num_generations = G = 2n`` rollouts into n clean and n
    noisy rows, so ``G`` must be even (and a multiple of 4 for the paired methods).
    """

    #: NC-GRPO's fields by topic: ``ncgrpo train --help`` lists them first under these headers
    #: (ncgrpo.commands.parser.ConfigParser) and docs/reference/settings.md is generated from them; a field of this
    #: class missing here fails tests/test_docs_site.py. Not a dataclass field (no annotation).
    help_groups = {
        "NC-GRPO: method": (
            "rollout_method",
            "antithetic_grouping",
            "spsa_lr",
            "spsa_mu_max",
            "spsa_min_sigma_ratio",
            "spsa_max_step_ratio",
            "image_noise_step",
        ),
        "NC-GRPO: noise": (
            "sigma0",
            "noise_site",
            "noise_layer_decay",
            "noise_positions",
            "noise_seed",
            "branch_prefix",
        ),
        "NC-GRPO: schedule": (
            "sigma_schedule",
            "schedule_gamma",
            "schedule_k_mid",
            "schedule_unit",
            "target_marginal_tv",
            "target_scope",
            "sigma_max",
        ),
        "NC-GRPO: controls": (
            "first_token_temperature",
            "first_token_temperature_auto",
            "first_token_marginal_draws",
        ),
        "NC-GRPO: sharing": ("share_prompt_prefill", "share_prompt_loss"),
        "NC-GRPO: probes and metrics": ("marginal_tv_draws",),
        "NC-GRPO: generation": ("max_prompt_length", "noisy_importance_sampling"),
    }
    #: The header of the fields NCGRPOConfig inherits (listed after the NC-GRPO groups and the command's own).
    help_rest_title = "TRL GRPOConfig and transformers TrainingArguments settings"

    rollout_method: str = field(
        default="latent",
        metadata={"help": f"How the noisy half of each group is generated: {method_help()}."},
    )
    sigma0: float = field(
        default=0.2,
        metadata={
            "help": "Initial noise scale sigma_0 of eq. (2)/(3) (latent/antithetic/spsa/first_token_marginal), in "
            "[0, 10]: the noise's size relative to the state (||delta|| ~ sigma0 ||h||; at 10 the perturbed state "
            "keeps a cosine of ~0.1 with the clean one). The paper uses 0.2 to 0.5."
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
    target_marginal_tv: float | None = field(
        default=None,
        metadata={
            "help": "Hold the noise's effect instead of its size: at each generation sigma_k is solved on that "
            "batch's branch-point states so that the batch's noise-averaged first-token TV(q, q_bar) (logged "
            "noise/first_token_marginal_tv) equals target_marginal_tv * decay_k (eq. 3's decay of sigma_schedule "
            "anneals the target); sigma0 is the solver's first guess. In (0, 1]; `ncgrpo probe` gives the TV a "
            "sigma0 has on a model. The TV held is the marginal_tv_draws-draw estimate (docs/concepts.md: within "
            "0.2 percent of a 16,384-draw reference on the embedded base at 64 draws). None (default): "
            "sigma_k = sigma0 * decay_k, the paper."
        },
    )
    target_scope: str = field(
        default="batch",
        metadata={
            "help": "target_marginal_tv: what holds the target. 'batch' (default): one sigma_k per generation, "
            "solved so that the batch's MEAN noise-averaged first-token TV is the annealed target; 'prompt': each "
            "prompt's own sigma, solved on its clean branch-point state inside the prefill, so that EVERY prompt's "
            "TV(q, q_bar) is the target (at one sigma the prompts' TVs spread widely; noise/sigma_k then logs the "
            "prompts' mean, noise/sigma_k_min and noise/sigma_k_max their range). Also on vLLM and verl."
        },
    )
    sigma_max: float = field(
        default=2.0,
        metadata={
            "help": "target_marginal_tv: the largest sigma_k the solver may use, in (0, 10]; a batch whose TV stays "
            "below the target there is generated at sigma_max (logged noise/sigma_at_max, warned)."
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
    share_prompt_prefill: bool = field(
        default=True,
        metadata={
            "help": "Transformers engine: compute the vision tower and the prompt minus its last token once per "
            "prompt (per half for the image method) and decode the group's rows from that cache, instead of once "
            "per row; the first-token logits agree within float rounding. Layer noise sites and "
            "noise_positions='all' prefill every row (they need it). vLLM shares through prefix caching already; "
            "rollout_method='vanilla' is TRL's path unchanged."
        },
    )
    share_prompt_loss: bool = field(
        default=False,
        metadata={
            "help": "Loss side (old-log-prob, reference and loss forwards, and the backward): forward the rows of "
            "a micro-batch that share a prompt (and its images) as one packed sequence, the vision tower and the "
            "prompt once, each completion attending to the prompt and to itself only; log-probabilities, "
            "entropies and gradients equal TRL's one-row-per-rollout forward within float rounding, with "
            "gradient checkpointing too; rows whose packing would cost more FLOPs than their own forward (long "
            "completions) keep TRL's. Text Qwen2/Qwen3/Llama and Qwen2/2.5/3-VL with attn_implementation 'sdpa' or "
            "'eager' (others are refused at start-up). On CPU it cut a small-size optimizer step to 0.45x of TRL's "
            "vanilla (with share_prompt_prefill); off by default because GPU speed is unmeasured and flash "
            "attention cannot take the mask (docs/benchmarks.md)."
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
        default=64,
        metadata={
            "help": "Extra eps draws per prompt through the LM head behind the logged noise/first_token_marginal_tv "
            "(final-norm site), the target schedule's solve and first_token_temperature_auto: an even number, "
            "taken as antithetic pairs (eps, -eps); 0 turns the metric off."
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
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            # Under the names this transformers wants (>= 5.18: `gradient_checkpointing*` are deprecated
            # aliases that warn at every config). TRL's default is on; the recipes write the old names
            # because vLLM's transformers (< 5.18) has no `activation_checkpointing*`, so values move.
            if getattr(self, new, False) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
                setattr(self, old, None)
        self._check_trl_ranges()  # before TRL's own checks, which name no field (or divide by zero)
        super().__post_init__()
        if self.dataloader_pin_memory and (self.use_cpu or not _has_accelerator()):
            # pinning needs an accelerator; torch's DataLoader warns at every epoch on a CPU-only machine
            self.dataloader_pin_memory = False
        method = get_method(self.rollout_method)  # an unknown name: ValueError naming the registered ones
        problem = sigma0_problem(self.sigma0)
        if problem is not None:
            raise ValueError(f"sigma0 {problem}")
        schedule = self.schedule  # eq. (3)'s settings: ValueError naming the one to fix
        self.noise_site = str(self.noise_site)
        parse_noise_site(self.noise_site)  # raises with a message saying what to write
        if not 0 < self.noise_layer_decay <= 1:
            raise ValueError(f"noise_layer_decay must be in (0, 1], got {self.noise_layer_decay}")
        if self.noise_positions not in ("auto", "all"):
            raise ValueError(f"noise_positions must be 'auto' or 'all', got {self.noise_positions!r}")
        if not isinstance(self.share_prompt_prefill, bool):
            raise ValueError(f"share_prompt_prefill must be true or false, got {self.share_prompt_prefill!r}")
        if not isinstance(self.share_prompt_loss, bool):
            raise ValueError(f"share_prompt_loss must be true or false, got {self.share_prompt_loss!r}")
        if self.antithetic_grouping not in ("joint", "separate"):
            raise ValueError(
                f"antithetic_grouping must be 'joint' or 'separate', got {self.antithetic_grouping!r}"
            )
        if (
            self.antithetic_grouping == "separate"
            and self.multi_objective_aggregation != "sum_then_normalize"
        ):
            raise ValueError(
                "antithetic_grouping='separate' recomputes TRL's 'sum_then_normalize' advantages over the new "
                "groups; set multi_objective_aggregation='sum_then_normalize'."
            )
        method.check_args(self)  # the group size, pairs, sites: what this method needs
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(
                f"max_prompt_length must be >= 1 (or None for no limit), got {self.max_prompt_length}"
            )
        for name in ("spsa_lr", "spsa_mu_max"):  # `< 0` alone lets NaN through (it compares False)
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.spsa_max_step_ratio is not None and not self.spsa_max_step_ratio > 0:
            raise ValueError(
                f"spsa_max_step_ratio must be > 0 (or None: unbounded), got {self.spsa_max_step_ratio}"
            )
        if not 0 <= self.spsa_min_sigma_ratio <= 1:
            raise ValueError(f"spsa_min_sigma_ratio must be in [0, 1], got {self.spsa_min_sigma_ratio}")
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
        if self.marginal_tv_draws % 2:
            raise ValueError(
                f"marginal_tv_draws must be even (the draws are antithetic pairs eps, -eps), got "
                f"{self.marginal_tv_draws}; use {self.marginal_tv_draws + 1} (0 turns the metric off)"
            )
        if self.first_token_temperature_auto and parse_noise_site(self.noise_site) != "final_norm":
            raise ValueError(
                "first_token_temperature_auto matches T0 to the final-norm site's noise-averaged first-token "
                f"distribution; noise_site={self.noise_site!r} has none through the LM head alone. Use "
                "noise_site='final_norm' or set first_token_temperature by hand."
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
        self._check_target(method)
        self._warn_schedule(schedule, method)
        if self.use_vllm and method.two_pass:
            self._check_vllm(method)

    def _check_trl_ranges(self) -> None:
        """Inherited fields whose bad values TRL / transformers take at config time and refuse (or fail
        on) only once the trainer runs, after the model has loaded: each refused here, naming the field.

        - ``seed``: ``transformers.set_seed`` seeds numpy, whose seed is an integer in [0, 2**32 - 1].
        - ``temperature``: the sampler and TRL's log-probabilities divide the logits by it (GRPO needs
          sampled rollouts: greedy decoding would give a group G identical rows and no advantage).
        - ``max_completion_length``: at least one generated token (None: TRL infers it from the model).
        - ``num_generations``: GRPO's advantage compares the rollouts of one prompt (TRL's own check
          names no field, and 0 divides by zero before it).
        - ``num_train_epochs`` without ``max_steps``: 0 epochs train 0 steps and "succeed".
        """

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not (is_int(self.seed) and 0 <= self.seed <= _SEED_MAX):
            raise ValueError(
                f"seed must be an integer in [0, {_SEED_MAX}] (numpy's seed range; transformers.set_seed "
                f"seeds numpy), got {self.seed!r}"
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
            raise ValueError(
                f"temperature must be a finite number > 0 (the sampling temperature: the sampler and the "
                f"loss divide the logits by it), got {t!r}"
            )
        m = self.max_completion_length
        if m is not None and not (is_int(m) and m >= 1):
            raise ValueError(
                f"max_completion_length must be an integer >= 1 (tokens generated per rollout; None: "
                f"inferred from the model's config), got {m!r}"
            )
        e = self.num_train_epochs
        if self.max_steps <= 0 and not (isinstance(e, int | float) and math.isfinite(e) and e > 0):
            raise ValueError(
                f"num_train_epochs must be a finite number > 0 when max_steps is not set (max_steps "
                f"{self.max_steps}), got {e!r}: the run would train 0 steps and save the base weights"
            )
        g = self.num_generations
        if not (is_int(g) and g >= 2):
            raise ValueError(
                f"num_generations must be an integer >= 2 (rollouts per prompt: GRPO's advantage compares "
                f"them), got {g!r}"
            )

    def _check_target(self, method) -> None:
        """``target_marginal_tv``: a TV in (0, 1], a ``sigma_max`` in (0, 10], a method whose noisy half is set
        by a sigma whose first-token marginal the LM head measures (the method's ``target_refusal``), the
        final-norm site and at least 2 ``marginal_tv_draws``."""
        problem = sigma0_problem(self.sigma_max, bound="the target schedule's bound on sigma_k")
        if problem is not None:
            raise ValueError(f"sigma_max {problem}")
        if self.target_scope not in TARGET_SCOPES:
            raise ValueError(
                f"target_scope must be one of {', '.join(repr(s) for s in TARGET_SCOPES)} ('batch': one sigma_k "
                f"for the batch's mean TV; 'prompt': each prompt's own sigma for its TV), got {self.target_scope!r}"
            )
        t = self.target_marginal_tv
        if t is None:
            return
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and 0 < t <= 1):
            raise ValueError(
                f"target_marginal_tv must be a total-variation distance in (0, 1] (or None: sigma_k = sigma0 * "
                f"decay_k), got {t!r}"
            )
        if method.target_refusal:
            raise ValueError(
                f"target_marginal_tv cannot set the noise of rollout_method={method.name!r}: {method.target_refusal}. "
                f"Use one of {', '.join(m.name for m in methods() if not m.target_refusal)}, or unset "
                "target_marginal_tv."
            )
        if parse_noise_site(self.noise_site) != "final_norm":
            raise ValueError(
                f"target_marginal_tv solves sigma_k on the noise-averaged first-token distribution through the LM "
                f"head alone, which noise at a layer site (noise_site={self.noise_site!r}) reaches only through "
                "the layers above it (a full forward per draw and per solver step). Use noise_site='final_norm' "
                "or unset target_marginal_tv."
            )
        if self.marginal_tv_draws < TARGET_DRAWS:
            raise ValueError(
                f"target_marginal_tv solves sigma_k on marginal_tv_draws draws per prompt (antithetic pairs, with "
                f"a jackknife bias correction, which needs three pairs or more); got marginal_tv_draws="
                f"{self.marginal_tv_draws}. Use {TARGET_DRAWS} or more (default 64)."
            )

    def _check_vllm(self, method) -> None:
        """What NC-GRPO supports with ``use_vllm=True`` (refused here, before any engine is started)."""
        if self.vllm_mode not in ("colocate", "server"):
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {self.vllm_mode!r}")
        method.check_vllm(self.vllm_mode)
        if parse_noise_site(self.noise_site) != "final_norm":
            raise NotImplementedError(
                f"noise_site={self.noise_site!r} (a propagating layer site) is not available with use_vllm: it would "
                "write noise into the KV cache of every prompt token, which vLLM's prefix cache shares between "
                "requests and chunked prefill splits. Use noise_site='final_norm' or use_vllm=False."
            )

    def _warn_schedule(self, schedule: Schedule, method) -> None:
        """Not refused: short smoke runs (max_steps=1..2) with the paper's k_mid=40 are common and then keep
        the noise near its start for the whole run. Said once, loudly."""
        K = self.max_steps
        if method.two_pass and not schedule.anneals_before(K):
            warnings.warn(
                f"schedule_k_mid={self.schedule_k_mid} is after the last step (max_steps={K}): the sigmoid "
                f"schedule never anneals, {method.anneals} (the paper uses k_mid = 40/60 K)",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )

    @property
    def schedule(self) -> Schedule:
        """eq. (3)'s schedule (:class:`ncgrpo.core.schedule.Schedule`) of these settings."""
        return Schedule.from_args(self)

    @property
    def noise_site_parsed(self) -> str | list[int]:
        return parse_noise_site(self.noise_site)


@contextmanager
def trl_checkpointing_calls() -> Iterator[None]:
    """TRL turns gradient checkpointing off and on around every generation by transformers' old names
    (``is_gradient_checkpointing``, ``gradient_checkpointing_disable`` / ``_enable``), which
    transformers 5.2x deprecates with a FutureWarning on every use. Only TRL can act on it, so inside
    this block it is not shown (the config's own deprecated field is avoided in
    :meth:`NCGRPOConfig.__post_init__`)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` "
            "is deprecated",
            category=FutureWarning,
        )
        yield
