"""A rollout method is one object, registered by name, holding everything that differs by method.

The trainer, the engines, the probe, the demo and the verl integration never compare a method's name;
they ask the method (``get_method(args.rollout_method)``) what it is and what to do:

- **what it is** (class attributes): ``two_pass`` (n clean + n noisy rows), ``paired`` (the noisy half
  as ``(+eps, -eps)`` pairs), ``key_rule`` (which noise key each noisy row carries,
  :func:`ncgrpo.core.plan.plan_rows`), ``noise_mode`` (eq. (2)'s draws on the hidden states, or
  ``None``: the forward stays clean), ``uses_sigma`` (the noisy half is set by ``sigma0`` and
  ``sigma_k``), ``marginal`` (how ``noise/first_token_marginal_tv`` is measured), ``anneals`` (what
  eq. (3)'s schedule anneals, in words);
- **where it runs**: ``vllm_refusal`` / ``vllm_server_refusal`` / ``verl_refusal`` / ``probe_refusal``:
  ``None`` where it runs, else the reason it is refused there (raised before any engine starts);
- **its settings' checks**: :meth:`check_args` (``NCGRPOConfig.__post_init__`` calls it);
- **its rows**: :meth:`row_noise` (the hidden-state instruction of one row) and :meth:`steer` (a
  steering vector added on every noisy row, SPSA's ``mu``), gathered into the generation's plan;
- **one generation**: :meth:`plan_generation`, the one call the trainer makes before it generates,
  returns a :class:`GenerationPlan` (the rows' noise, the steering vector, the inputs the rows generate
  from, the hooks around TRL's ``generate``; on vLLM the images and first-token logit scales of the
  requests), which both engines consume. By default it composes the finer hooks a method overrides:
  :meth:`begin_generation` (this step's annealed values, the method's own in ``gen.method_values``),
  :meth:`row_noise`, :meth:`steer`, :meth:`generation_inputs`, :meth:`generation_hooks`,
  :meth:`noisy_first_token_temperature`, :meth:`vllm_images` and :meth:`vllm_logit_scales`; on verl:
  :meth:`verl_extra_args`;
- **after rewards**: :meth:`after_rewards` (SPSA's update of ``mu``) and :meth:`metrics`;
- **state**: :meth:`init_state`, :meth:`state_dict` / :meth:`load_state_dict` (``ncgrpo_state.pt`` in
  checkpoints).

The trainer-facing hooks get the trainer (``tr``, typed :class:`TrainerView`) and the generation's
record (``gen``, :class:`Generation`); each says what it reads and writes. A method's own per-generation
values (the image method's ``image_t``, the control's first-token temperature, SPSA's ``mu_norm``) live
in ``gen.method_values``, which :class:`StepRecord` keeps; the records name no method's field. A new
method is one module that subclasses :class:`RolloutMethod` (or a built-in method) and decorates it
with :func:`register_method`; docs/extending.md walks through one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from ncgrpo.core.noise import RowNoise, parse_noise_site
from ncgrpo.core.plan import RowPlan

if TYPE_CHECKING:
    from ncgrpo.core.schedule import Schedule

__all__ = [
    "Generation",
    "GenerationPlan",
    "RolloutMethod",
    "StepRecord",
    "TrainerView",
    "baseline_method",
    "get_method",
    "method_help",
    "method_names",
    "methods",
    "read_state",
    "register_method",
    "unregister_method",
]

_REGISTRY: dict[str, RolloutMethod] = {}


class TrainerView(Protocol):
    """Exactly what a rollout method's hooks may use of the trainer (``tr``; ``NCGRPOTrainer`` is one).
    A method reads these and nothing else (``tests/methods/test_registry.py`` checks every ``tr.<name>``
    in ``ncgrpo.methods``); it writes only ``nc_state``, its own state (:meth:`RolloutMethod.init_state`)."""

    #: the run's settings (``NCGRPOConfig``)
    args: Any
    #: eq. (3)'s schedule: ``sigma``, ``target``, ``image_t``, ``temperature``
    schedule: Schedule
    #: the sampling temperature
    temperature: float
    #: the processor / tokenizer (the image method distorts its images through it)
    processing_class: Any
    #: the method's own state (what :meth:`RolloutMethod.init_state` returned)
    nc_state: Any
    #: TRL's vLLM engine generates (True) or transformers' ``generate`` (False)
    use_vllm: bool

    @property
    def noise_base_seed(self) -> int:
        """The seed every noise key derives from."""
        ...

    def hidden_size(self) -> int:
        """The size of the hidden states the noise acts on."""
        ...

    def solve_target_sigma(self, gen: Generation, prompt_ids: Any, multimodal_fields: Any) -> Any:
        """``target_marginal_tv``: solve this generation's sigma_k (writes ``gen.sigma_k``)."""
        ...

    def calibrate_first_token_t0(
        self, plans: list[RowPlan], prompt_ids: Any, multimodal_fields: Any
    ) -> float:
        """``first_token_temperature_auto``: the calibrated T0 (one prompt-only pass)."""
        ...


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
    rows: list[tuple]
    rewards: list[float]
    advantages: list[float]
    local_rows: list[tuple] = field(default_factory=list)
    rel: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    #: the method's own values of this generation (``Generation.method_values`` after rewards: the image
    #: method's ``image_t``, the control's ``first_token_temperature``, SPSA's ``mu_norm`` before its update)
    method_values: dict[str, Any] = field(default_factory=dict)


def _no_hooks(model: Any) -> AbstractContextManager:
    return nullcontext()


@dataclass
class GenerationPlan:
    """What one generation gets from its method (:meth:`RolloutMethod.plan_generation`, the one call the
    trainer makes before generating), read by both engines' paths:

    ``rows``: each local row's hidden-state noise (:meth:`RolloutMethod.row_noise` at ``gen.sigma_k``; the
    target schedule re-decides them in the prefill); ``inputs``: the multimodal inputs the rows generate
    from on the transformers engine, also what the vLLM path's measurement pass reads (the image method's
    distorted ``pixel_values``; TRL's loss keeps the originals); ``hooks``: ``hooks(model)`` is a context
    manager entered around TRL's ``generate`` on the transformers engine, yielding the control hook whose
    rewritten first-token logits the branch-point metrics read, or None; ``steer``: a steering vector on
    every noisy row (SPSA's ``mu``) or None; ``noisy_first_token_temperature``: the temperature the noisy
    rows sample their first token at where the method rescales it (None: the sampling temperature). vLLM
    only (None on the transformers engine): ``images``, the per-row images the engine gets, and
    ``logit_scales``, per row a first-token logit scale the plugin applies (None: none)."""

    rows: list[RowNoise]
    inputs: dict
    hooks: Callable[[Any], AbstractContextManager] = _no_hooks
    steer: Any = None
    noisy_first_token_temperature: float | None = None
    images: Any = None
    logit_scales: list[float | None] | None = None


@dataclass
class Generation:
    """One generation's record on this rank (local rows only): what the trainer and the method write while
    ``NCGRPOTrainer._generate_single_turn`` runs, and what the metrics read after rewards."""

    step: int
    total_steps: int
    sigma_k: float
    plans: list[RowPlan]
    schedule_k: int = 0  # k of eq. (3) in `schedule_unit`
    #: the method's own values of this generation, written and read by the method (its
    #: :meth:`RolloutMethod.begin_generation`, :meth:`RolloutMethod.after_rewards`; ``StepRecord`` keeps them)
    method_values: dict[str, Any] = field(default_factory=dict)
    #: what the method planned for this generation (:meth:`RolloutMethod.plan_generation`)
    plan: GenerationPlan | None = None
    target_tv: float | None = None  # target_marginal_tv: this generation's annealed target
    target_solve: object | None = (
        None  # target_marginal_tv: the solver's SigmaSolve (PromptScopeSolve per prompt)
    )
    #: target_scope='prompt': each local row's own sigma (its prompt's solve); None: ``sigma_k`` for every row
    row_sigma: list[float] | None = None
    rel: torch.Tensor | None = None  # [L]
    branch_argmax: torch.Tensor | None = None  # [L] argmax of the logits at the branch point
    branch_marginal: torch.Tensor | None = None  # [L] TV(q, q_bar) on each group's first noisy row, else NaN
    branch_tv: torch.Tensor | None = None  # [L] first-token TV vs the clean partner (NaN: clean row)
    branch_agreement: torch.Tensor | None = None  # [L] eq. (4) on first-token distributions
    first_token: torch.Tensor | None = None  # [L]

    @property
    def first_token_temperature(self) -> float | None:
        """The plan's ``noisy_first_token_temperature`` (None: the sampling temperature, or not planned
        yet), under the name the shared branch-point code reads (``record_branch_point``,
        ``branch_point_marginal`` in :mod:`ncgrpo.trainer.generation`): what it measures the noisy rows'
        first-token distribution at. Not a stored field: the method's value is its plan's."""
        return None if self.plan is None else self.plan.noisy_first_token_temperature


@contextmanager
def _method_hooks(method: RolloutMethod, tr: TrainerView, gen: Generation, model: Any):
    """:meth:`RolloutMethod.generation_hooks` as one context manager (a plan's default ``hooks``)."""
    with ExitStack() as stack:
        yield method.generation_hooks(tr, gen, model, stack)


class RolloutMethod:
    """The base of every rollout method (see the module docstring). Subclasses set the class
    attributes and override the hooks that differ; the defaults are a two-pass method whose noisy half
    is identical to its clean half (no noise, no control), which no built-in method is."""

    #: the ``rollout_method`` value (config field, CLI flag, recipe key, records)
    name: ClassVar[str] = ""
    #: one line for ``--help`` and docs
    summary: ClassVar[str] = ""
    #: its name in tables (``ncgrpo demo``'s rows; default: ``name``) and its run folders' stem (default:
    #: ``name`` with dashes)
    label: ClassVar[str] = ""
    slug: ClassVar[str] = ""
    #: the baseline every test compares against (vanilla GRPO): the demo's first row, the model card's plain
    #: GRPO line; exactly one registered method sets it
    baseline: ClassVar[bool] = False
    #: ``ncgrpo demo`` trains it by default, one run per ``sigma0`` (the others with ``--all_methods``, at
    #: the first ``sigma0``)
    in_demo_by_default: ClassVar[bool] = False
    #: groups are n clean + n noisy rows (False: vanilla GRPO)
    two_pass: ClassVar[bool] = True
    #: the noisy half is ``(+eps, -eps)`` pairs sharing one key (n must be even)
    paired: ClassVar[bool] = False
    #: the key each noisy row carries: ``row`` (draw ``j``), ``pair`` (draw ``j // 2``, sign by parity),
    #: ``prompt`` (draw 0 for the whole noisy half) or ``none``
    key_rule: ClassVar[str] = "row"
    #: eq. (2)'s noise mode on the hidden states (:func:`ncgrpo.core.noise.draw_eps`), None: none
    noise_mode: ClassVar[str | None] = None
    #: the noisy half is set by ``sigma0`` and eq. (3)'s ``sigma_k`` (``noise/sigma_k`` is logged)
    uses_sigma: ClassVar[bool] = False
    #: how ``noise/first_token_marginal_tv`` is measured: ``draws`` (``marginal_tv_draws`` keyed draws
    #: through the LM head, final-norm site), ``temperature`` (exact: ``softmax(z / T_k)``) or None
    marginal: ClassVar[str | None] = None
    #: what eq. (3)'s schedule anneals, for the warning when it never anneals
    anneals: ClassVar[str] = "sigma stays near sigma0"
    #: why the method works at the final-norm site only (None: any noise site)
    final_norm_only: ClassVar[str | None] = None
    #: the noisy half rescales the sampling temperature, so sampling must be at a temperature > 0
    needs_sampling_temperature: ClassVar[bool] = False
    #: why the method cannot generate on vLLM (None: it can)
    vllm_refusal: ClassVar[str | None] = None
    #: why it cannot generate on a vLLM server (``vllm_mode='server'``), None: it can
    vllm_server_refusal: ClassVar[str | None] = None
    #: why the verl integration refuses it (None: it runs there)
    verl_refusal: ClassVar[str | None] = (
        "the verl integration sends a noise spec per session and has no hook for this method"
    )
    #: why the target schedule (``target_marginal_tv``: sigma_k solved per generation for a noise-averaged
    #: first-token TV) cannot set this method's noise (None: it can)
    target_refusal: ClassVar[str | None] = (
        "its noisy half is not set by a sigma whose noise-averaged first-token distribution the LM head measures"
    )
    #: why ``ncgrpo probe`` refuses it (None: the probe measures its hidden-state noise)
    probe_refusal: ClassVar[str | None] = (
        "the probe measures hidden-state noise (eq. 2) and this method puts none in the forward"
    )

    # -- what it is ---------------------------------------------------------------------------------
    @property
    def hidden_noise(self) -> bool:
        """eq. (2) acts on the hidden states of the noisy rows."""
        return self.noise_mode is not None

    def __repr__(self) -> str:
        return f"<rollout method {self.name!r}>"

    @property
    def help_line(self) -> str:
        """Its entry in every ``--help`` that lists the methods (:func:`method_help`)."""
        return f"'{self.name}' ({self.summary})" if self.summary else f"'{self.name}'"

    # -- the model card -----------------------------------------------------------------------------
    def card_settings(self, args: Any) -> list[str]:
        """Its own settings, named on the model card after the noise scale and the schedule."""
        return []

    def card_noise(self, args: Any, schedule: str) -> list[str]:
        """What sets the noisy half's noise on the model card: ``sigma0`` (or the target TV the schedule
        holds), ``schedule`` (the schedule's phrase), :meth:`card_settings` and the noise site."""
        if getattr(args, "target_marginal_tv", None) is not None:
            scale = (
                f"target_marginal_tv {args.target_marginal_tv} (sigma_k solved at each generation so that the "
                f"batch's noise-averaged first-token TV is target_marginal_tv * decay_k; sigma0 {args.sigma0} the "
                f"solver's first guess, sigma_max {args.sigma_max})"
            )
        else:
            scale = f"sigma0 {args.sigma0} (sigma_k = sigma0 * decay_k)"
        site = f"noise site `{args.noise_site}`"
        if args.noise_site != "final_norm":
            site += f" (noise_layer_decay {args.noise_layer_decay})"
        return [scale, schedule, *self.card_settings(args), site]

    def card_line(self, args: Any, schedule: str) -> str:
        """The model card's sentence for the method as run (``schedule``: the schedule's phrase)."""
        G = getattr(args, "num_generations", None)
        parts = [f"rollout_method `{self.name}`", *self.card_noise(args, schedule)]
        if getattr(args, "branch_prefix", ""):
            parts.append(f"branch_prefix {args.branch_prefix!r}")
        return f"NC-GRPO (Noise-Contrastive GRPO; G = {G}: {G // 2} clean + {G // 2} noisy rollouts; " + (
            ", ".join(parts) + ")"
        )

    @property
    def card_title(self) -> str:
        """The method in the model card's one-line summary."""
        return f"NC-GRPO (rollout_method `{self.name}`)"

    # -- settings -----------------------------------------------------------------------------------
    def check_group_size(self, G: int, *, field: str = "num_generations") -> None:
        """The one check of the group size ``G`` (``field`` names the setting in the message)."""
        G = int(G)
        if G < 1:
            raise ValueError(f"{field} must be >= 1, got {G}")
        if self.two_pass and G % 2:
            raise ValueError(
                f"rollout_method={self.name!r} splits each group into n clean + n noisy rollouts, so {field} must "
                f"be even; got {G}. Use {G + 1} (or {G - 1})."
            )
        if self.paired and G % 4:
            raise ValueError(
                f"rollout_method={self.name!r} puts the noisy half (n = {field} // 2 = {G // 2}) in (+eps, -eps) "
                f"pairs, so n must be even, i.e. {field} a multiple of 4; got {G}."
            )

    def check_args(self, args: Any) -> None:
        """Refuse settings this method cannot use (``args``: an ``NCGRPOConfig``); ``ValueError`` naming
        the setting and what to write instead. Called by ``NCGRPOConfig.__post_init__``."""
        self.check_group_size(args.num_generations)
        if args.antithetic_grouping == "separate" and not self.paired:
            raise ValueError(
                "antithetic_grouping='separate' regroups (+eps, -eps) pairs and only applies to the paired methods "
                f"({', '.join(m.name for m in methods() if m.paired)}), not {self.name!r}; leave it at 'joint'."
            )
        if self.final_norm_only and parse_noise_site(str(args.noise_site)) != "final_norm":
            raise ValueError(
                f"rollout_method={self.name!r} {self.final_norm_only}; noise_site={args.noise_site!r}. Use "
                "noise_site='final_norm'."
            )

    def check_vllm(self, vllm_mode: str) -> None:
        """``NotImplementedError`` with the reason where this method cannot generate on vLLM."""
        if self.vllm_refusal:
            raise NotImplementedError(
                f"rollout_method={self.name!r} on vLLM: {self.vllm_refusal}. Use use_vllm=False."
            )
        if vllm_mode == "server" and self.vllm_server_refusal:
            raise NotImplementedError(
                f"rollout_method={self.name!r} with vllm_mode='server' is not supported: {self.vllm_server_refusal}"
            )

    def check_probe(self) -> None:
        """``ValueError`` with the reason where ``ncgrpo probe`` cannot measure this method."""
        if self.probe_refusal:
            raise ValueError(
                f"rollout_method={self.name!r} cannot be probed: {self.probe_refusal}; probe one of "
                f"{', '.join(m.name for m in methods() if not m.probe_refusal)}"
            )

    def demo_run(
        self, cfg: Any, sigma0: float, *, target: float | None = None
    ) -> tuple[str, str, dict[str, Any]] | None:
        """``(row name, folder stem, settings)`` of this method's run in ``ncgrpo demo`` (``cfg``: the
        demo's ``DemoConfig``), or None where the demo leaves it out. A method that takes the noise site
        (hidden noise) gets the demo's site, named in the row (``@L1``) and the folder (``-L1``), and may
        refuse it; one that does not but is defined at the final-norm site only is left out at another
        site. ``sigma0`` is named where the method uses it; with a ``target`` (the target schedule's
        ``target_marginal_tv``; ``sigma0`` is then its solver's first guess) the target is named instead
        (``TV=0.0066``, ``-tv0.0066``)."""
        site, layer = cfg.noise_site, cfg.noise_site != "final_norm"
        if layer and self.final_norm_only and not self.hidden_noise:
            return None
        label, slug = self.label or self.name, self.slug or self.name.replace("_", "-")
        if not self.uses_sigma:
            return label, slug, {}
        at = f" @L{site}" if layer and self.hidden_noise else ""
        tag = "-L" + site.replace(",", "_") if layer and self.hidden_noise else ""
        settings: dict[str, Any] = {"sigma0": sigma0}
        if self.hidden_noise:
            settings["noise_site"] = site  # where the noise acts: the hidden-noise methods' setting
        if target is not None:
            settings["target_marginal_tv"] = target
            scope = getattr(cfg, "target_scope", "batch")
            if scope != "batch":  # the batch scope's names and settings are those of the runs made before it
                settings["target_scope"] = scope
                return f"{label} TV={target:g} per {scope}{at}", f"{slug}-tv{target:g}-{scope}{tag}", settings
            return f"{label} TV={target:g}{at}", f"{slug}-tv{target:g}{tag}", settings
        return f"{label} σ0={sigma0:g}{at}", f"{slug}-sigma{sigma0:g}{tag}", settings

    # -- rows ---------------------------------------------------------------------------------------
    def row_noise(self, plan: RowPlan, sigma: float) -> RowNoise:
        """The hidden-state instruction for one row (clean unless the method injects hidden noise)."""
        if self.noise_mode is None or not plan.noisy or plan.key is None:
            return RowNoise()
        return RowNoise(sigma=float(sigma), key=plan.key, sign=plan.sign, mode=self.noise_mode)

    def steer(self, tr: TrainerView) -> Any:
        """A steering vector added to every noisy row's state (eq. 6's ``mu``), or None."""
        return None

    def initial_steer(self, hidden_size: int) -> Any:
        """The steering vector before any training (the probe uses it), or None."""
        return None

    # -- one generation -----------------------------------------------------------------------------
    def plan_generation(
        self, tr: TrainerView, gen: Generation, prompt_ids: Any, images: Any, multimodal_fields: dict
    ) -> GenerationPlan:
        """Everything this generation needs of the method, in one object (the trainer's one call per
        generation, on every engine; kept as ``gen.plan``): this generation's annealed values
        (:meth:`begin_generation` at ``gen.schedule_k`` of ``gen.total_steps``), each local row's noise
        (:meth:`row_noise`), :meth:`steer`, the inputs the rows generate from (:meth:`generation_inputs`),
        the hooks around TRL's ``generate`` (:meth:`generation_hooks`), the noisy rows' first-token
        temperature (:meth:`noisy_first_token_temperature`) and, on vLLM, the requests' images and logit
        scales (:meth:`vllm_images`, :meth:`vllm_logit_scales`). ``prompt_ids``, ``images``,
        ``multimodal_fields``: this rank's rows as TRL hands them to ``generate``. Override the finer
        hooks; override this one where a method plans its generation otherwise."""
        self.begin_generation(tr, gen, gen.schedule_k, gen.total_steps, prompt_ids, multimodal_fields)
        plan = GenerationPlan(
            rows=[self.row_noise(p, gen.sigma_k) for p in gen.plans],
            inputs=self.generation_inputs(tr, gen, images, multimodal_fields),
            hooks=partial(_method_hooks, self, tr, gen),
            steer=self.steer(tr),
            noisy_first_token_temperature=self.noisy_first_token_temperature(tr, gen),
        )
        if tr.use_vllm:
            plan.images = self.vllm_images(tr, gen, images)
            plan.logit_scales = self.vllm_logit_scales(tr, gen)
        gen.plan = plan
        return plan

    def begin_generation(
        self, tr: TrainerView, gen: Any, k: int, K: int, prompt_ids: Any, multimodal_fields: dict
    ) -> None:
        """Set this generation's annealed values on ``gen`` (``sigma_k``; the method's own in
        ``gen.method_values``: the image method's ``image_t``, the control's ``first_token_temperature``)
        at schedule position ``k`` of ``K``, before any row is generated, on every engine. ``prompt_ids`` / ``multimodal_fields``: this rank's rows (the control
        calibrates its T0 on them; the target schedule solves sigma_k on them). Reads ``tr.args``,
        ``tr.schedule``; writes ``gen``."""
        if not self.uses_sigma:
            gen.sigma_k = 0.0
        elif tr.args.target_marginal_tv is not None:  # sigma_k solved for the annealed TV on this batch
            gen.target_tv = tr.schedule.target(k, K, tr.args.target_marginal_tv)
            # solved in the generation's own pass (sigma0 until then): the transformers engine's prefill
            # (NCGRPOTrainer._nc_generate); on vLLM the trainer's measurement pass, run before the engine
            # generates (batch scope), or the engine's own prefill (prompt scope; ncgrpo.trainer.vllm)
            gen.sigma_k = float(tr.args.sigma0)
        else:
            gen.sigma_k = tr.schedule.sigma(k, K, tr.args.sigma0)

    def generation_inputs(self, tr: TrainerView, gen: Any, images: Any, multimodal_fields: dict) -> dict:
        """The multimodal inputs TRL's ``generate`` gets (transformers engine; the loss keeps the
        originals). Default: unchanged."""
        return multimodal_fields

    def generation_hooks(self, tr: TrainerView, gen: Any, model: Any, stack: ExitStack) -> Any:
        """Enter into ``stack`` what runs around TRL's ``generate`` on the transformers engine besides the
        prefill noise hook (which every method gets with its :meth:`row_noise` rows). Returns the control
        hook whose rewritten first-token logits (``last_logits``) the branch-point metrics read, or None.
        Default: nothing."""
        return None

    def noisy_first_token_temperature(self, tr: TrainerView, gen: Any) -> float | None:
        """The temperature the noisy rows sample their first token at, where the method rescales it (the
        control's ``T_k``), else None (the sampling temperature)."""
        return None

    def vllm_images(self, tr: TrainerView, gen: Any, images: Any) -> Any:
        """The per-row images vLLM gets (default: TRL's)."""
        return images

    def vllm_logit_scales(self, tr: TrainerView, gen: Any) -> list[float | None] | None:
        """Per row, a first-token logit scale the vLLM plugin applies (None: none)."""
        return None

    def verl_extra_args(self, cfg: Any, plan: RowPlan, step: int, temperature: float) -> tuple[float, dict]:
        """``(sigma, SamplingParams.extra_args)`` of one noisy verl session (the vLLM plugin's spec)."""
        raise NotImplementedError(f"rollout_method={self.name!r} on verl: {self.verl_refusal}")

    # -- after rewards ------------------------------------------------------------------------------
    def after_rewards(
        self, tr: TrainerView, gen: Any, plans: list[RowPlan], rewards: Any, metrics: dict[str, float]
    ) -> None:
        """Anything the method does with the gathered rewards of a generation (SPSA's update), writing
        what it logs into ``metrics`` and what it records into ``gen.method_values``. Runs on every rank
        with the same inputs. Default: nothing."""

    def metrics(self, tr: TrainerView, gen: Any) -> dict[str, float]:
        """The method's own per-generation metrics (beside ``reward/*`` and ``noise/*``)."""
        return {"noise/sigma_k": gen.sigma_k} if self.uses_sigma else {}

    # -- state in checkpoints -----------------------------------------------------------------------
    def init_state(self, tr: TrainerView) -> Any:
        """The method's own state, created at the trainer's construction and kept as ``tr.nc_state``
        (SPSA: its steering vector ``mu``; the temperature control: its calibrated ``t0``); None: none.
        Only the method reads and writes it; :meth:`state_dict` / :meth:`load_state_dict` carry it
        through checkpoints."""
        return None

    def state_dict(self, tr: TrainerView) -> dict[str, Any]:
        """What the method adds to ``ncgrpo_state.pt`` from ``tr.nc_state``."""
        return {}

    def load_state_dict(self, tr: TrainerView, path: str) -> None:
        """Restore ``tr.nc_state`` from a checkpoint's ``ncgrpo_state.pt`` at ``path`` (read it with
        :func:`read_state`, which gives None for a missing file). Default: nothing to restore, the file is
        not read."""


def read_state(path: str) -> dict[str, Any] | None:
    """The dict in an ``ncgrpo_state.pt`` (None where the file is missing)."""

    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def register_method(cls: type[RolloutMethod]) -> type[RolloutMethod]:
    """Class decorator: register one instance of ``cls`` under ``cls.name`` (refused if taken). ``cls``
    must be a subclass of :class:`RolloutMethod` with a class attribute ``name``."""
    if not isinstance(cls, type):
        raise TypeError(
            f"register_method takes a RolloutMethod subclass (use it as a class decorator: @register_method "
            f"above 'class MyMethod(RolloutMethod): name = \"my_method\"'), got the {type(cls).__name__} {cls!r}"
        )
    if not issubclass(cls, RolloutMethod):
        raise TypeError(
            f"register_method: {cls.__qualname__} is not a RolloutMethod subclass; derive it from "
            "ncgrpo.methods.RolloutMethod (docs/extending.md), which gives the trainer the hooks it calls"
        )
    name = getattr(cls, "name", "")
    if not name or not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"{cls.__qualname__}: a rollout method needs a class attribute name that is a Python identifier "
            f'(e.g. name = "my_method"), got {name!r}'
        )
    if cls.key_rule not in ("row", "pair", "prompt", "none"):
        raise ValueError(f"{name}: key_rule must be 'row', 'pair', 'prompt' or 'none', got {cls.key_rule!r}")
    if name in _REGISTRY and type(_REGISTRY[name]) is not cls:
        raise ValueError(
            f"rollout method {name!r} is registered already ({type(_REGISTRY[name]).__qualname__})"
        )
    _REGISTRY[name] = cls()
    return cls


def unregister_method(name: str) -> None:
    """Remove a registered method (tests that register a toy method clean up with this)."""
    _REGISTRY.pop(name, None)


def get_method(name: str | RolloutMethod) -> RolloutMethod:
    """The registered method named ``name`` (a method object is returned as is); ``ValueError`` naming
    the registered ones otherwise."""
    if isinstance(name, RolloutMethod):
        return name
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"rollout_method={name!r} is unknown; use one of {', '.join(method_names())}"
        ) from None


def methods() -> list[RolloutMethod]:
    """Every registered method, in registration order (the built-ins first)."""
    return list(_REGISTRY.values())


def method_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def baseline_method() -> RolloutMethod:
    """The registered baseline (:attr:`RolloutMethod.baseline`: vanilla GRPO)."""
    found = [m for m in _REGISTRY.values() if m.baseline]
    if len(found) != 1:
        raise RuntimeError(f"exactly one registered rollout method must be the baseline, found {found}")
    return found[0]


def method_help(which: list[RolloutMethod] | None = None, *, last: str = "or") -> str:
    """The registered methods (or ``which``) as one ``--help`` phrase from their :attr:`~RolloutMethod.help_line`:
    the one list of method names in help strings."""
    lines = [m.help_line for m in (methods() if which is None else which)]
    return lines[0] if len(lines) == 1 else f"{', '.join(lines[:-1])} {last} {lines[-1]}"
