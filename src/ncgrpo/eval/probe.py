"""``ncgrpo probe``: does the prefill noise change anything, before a training run pays for it?

At the paper's site the displacement reaches only the first-token logits (section 3.1, "Where the
perturbation acts"). If the model's first token is (nearly) certain -- a format token such as
``<think>`` -- NC-GRPO samples exactly vanilla GRPO's rollouts. The probe measures that on ``N``
prompts, for each noise scale, at the configured site and ``branch_prefix``:

* ``entropy``: the clean first-token entropy (nats), at the sampling temperature;
* ``marginal_tv``: ``TV(q, q_bar)``, the total-variation distance between the clean first-token
  distribution ``q`` and the noise-averaged one ``q_bar = E_eps[q_eps]``, with its Monte Carlo
  standard error ``marginal_tv_se``, and ``marginal_kl`` = ``KL(q_bar || q)``. This is what generates
  the noisy half's rollouts (:mod:`ncgrpo.core.marginal`: each noisy row samples its first token from
  its own ``q_eps``, so the half samples from the mixture); the verdict reads it. At the final-norm
  site it is estimated from ``marginal_draws`` extra draws per prompt through the LM head (no
  forward pass); at a layer site from the rollouts' own ``rollouts`` draws per prompt (more error);
* ``equivalent_temperature``: the single first-token temperature whose distribution is closest to
  ``q_bar`` (mean TV over prompts): how far the noise moves the rollouts, in temperature units;
* ``matched_temperature``: the starting temperature ``T0`` of the first-token-temperature control
  whose mean first-token TV equals ``marginal_tv`` (the control matched on what generates rollouts);
  ``matched_temperature_per_draw`` is the older calibration on ``tv`` (per draw), kept for comparison:
  it moves the sampled distribution far more than the noise does;
* ``target_sigma`` (with ``target_marginal_tv``): the noise scale whose marginal TV reaches a requested
  value (final-norm site; bisection with the same draws at every sigma);
* ``tv``: the mean per-draw total-variation distance ``TV(q, q_eps)`` between the clean and one noisy
  first-token distribution (what ONE draw does; larger than ``marginal_tv``, up to ~10x);
* ``flip``: how often the noisy argmax differs from the clean argmax;
* ``changed``: the fraction of noisy rollouts that differ from their clean partner sampled with the
  same random numbers (common random numbers: the clean batch and each noisy batch have the same
  layout and the same sampler seed, so row ``r`` of both draws the same uniforms at every step --
  ``torch.multinomial`` with one sample uses one exponential per (row, token) -- and only the noise
  differs; sigma = 0 gives exactly 0%);
* ``first_changed``: the same, for the first generated token only;
* ``reward_clean`` / ``reward_noisy``: mean reward of the clean and the noisy rollouts (the training
  reward, :data:`ncgrpo.rewards.math_reward` unless other reward functions are given, on the completion
  with the branch prefix in front) and
  ``p_value``: a paired t-test over prompts of (noisy mean - clean mean) (1.0 when every difference
  is 0);
* a verdict per scale, on the marginal: ``inert`` (``marginal_tv`` < 0.002), ``weak`` (< 0.02) or
  ``live``. ``changed`` / ``tv`` are per-draw quantities and do not decide it.

Per prompt (``SigmaProbe.per_prompt``): the question id, clean entropy, per-draw TV, marginal TV and
its error, and the KL.

Noise keys are the noisy half of :func:`ncgrpo.core.plan.plan_group`'s ``NoiseKey(seed, 0, prompt_id, j)`` (step 0,
prompt ids from :func:`ncgrpo.core.plan.prompt_noise_id`), applied with
:func:`ncgrpo.engines.transformers.prefill_noise`: the same hook and draws training uses.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy import stats
from tqdm.auto import tqdm

from ncgrpo import models  # models.available_memory: looked up at the call (tests stand in for it)
from ncgrpo.core.agreement import match_first_token_temperature
from ncgrpo.core.marginal import (
    MarginalCurve,
    as_estimate,
    closest_temperature,
    marginal_estimate,
    marginal_keys,
    solve_sigma_for_marginal_tv,
    t_quantile,
)
from ncgrpo.core.noise import RowNoise, noise_seed
from ncgrpo.core.plan import plan_group, prompt_noise_id
from ncgrpo.data.prompts import render_prompt
from ncgrpo.data.types import Question
from ncgrpo.engines.branch_point import (
    branch_point_capture,
    cut_after_eos,
    eos_token_ids,
    find_text_stack,
    unwrap_model,
)
from ncgrpo.engines.shared_prefill import (
    share_prompt_prefill as sharing,  # the parameter of that name says whether to share
)
from ncgrpo.engines.transformers import Site, prefill_noise
from ncgrpo.eval.probe_result import TARGET_SIGMA_MAX, ProbeResult, SigmaProbe, verdict
from ncgrpo.methods import RolloutMethod, get_method, methods
from ncgrpo.models import tokenizer_of
from ncgrpo.rewards import math_reward
from ncgrpo.runs.provenance import provenance
from ncgrpo.trainer.prefix import prefix_completions, with_branch_prefix

__all__ = ["probe"]


def _inputs(processor: Any, questions: Sequence[Question], repeat: int, device: torch.device) -> dict:
    """Left-padded model inputs for ``questions``, each row repeated ``repeat`` times (prompt-major)."""
    texts = [render_prompt(processor, q) for q in questions]
    rep = [t for t in texts for _ in range(repeat)]
    tok = tokenizer_of(processor)
    old = getattr(tok, "padding_side", "left")
    tok.padding_side = "left"
    try:
        if any(q.images for q in questions):
            if not all(q.images for q in questions):
                raise ValueError("probe: a batch mixes questions with and without images")
            images = [[im.convert("RGB") for im in q.images] for q in questions for _ in range(repeat)]
            enc = processor(text=rep, images=images, padding=True, return_tensors="pt")
        else:
            enc = tok(rep, padding=True, return_tensors="pt", add_special_tokens=False)
    finally:
        tok.padding_side = old
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in dict(enc).items()}


def _sample(
    model: Any,
    inputs: dict,
    rows: list[RowNoise],
    *,
    seed: int,
    site: Site,
    layer_decay: float,
    temperature: float,
    max_new_tokens: int,
    pad_id: int | None,
    share_prompt_prefill: bool = True,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """One seeded sampling call under the prefill hook.

    Returns (completion ids per row cut after the first EOS, first-token logits ``# [B, V]`` float32
    on the CPU as the sampler sees them before temperature, measured ``rel`` ``# [B]``, the LM head's
    input at the branch point ``# [B, d]`` in the model's dtype: the final-norm state, noisy on noisy
    rows at the final-norm site)."""
    device = next(model.parameters()).device
    with (
        branch_point_capture(model) as point,
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
    ):
        torch.manual_seed(seed)
        with (
            torch.no_grad(),
            prefill_noise(model, rows, site=site, layer_decay=layer_decay) as hook,
            sharing(model, share_prompt_prefill),
        ):
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
            )
    T = inputs["input_ids"].shape[1]
    ids = cut_after_eos(out[:, T:].tolist(), eos_token_ids(model))
    return ids, point.logits.cpu(), hook.last.rel.float(), point.states


def _paired_p(diffs: Sequence[float]) -> float:
    if len(diffs) < 2 or all(abs(d) < 1e-12 for d in diffs):
        return 1.0

    p = float(stats.ttest_rel([0.0] * len(diffs), list(diffs)).pvalue)
    return 1.0 if math.isnan(p) else p


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _check_settings(
    questions: Sequence[Question],
    sigmas: Sequence[float],
    *,
    rollouts: int,
    site: Site,
    method: RolloutMethod,
    temperature: float,
    marginal_draws: int,
    target_marginal_tv: float | None,
) -> list[float]:
    """:func:`probe`'s settings refused before any model call; returns the sigmas as floats."""
    if not questions:
        raise ValueError("probe: no questions")
    if rollouts < 1:
        raise ValueError(f"probe: rollouts must be >= 1, got {rollouts}")
    if method.probe_refusal:
        probed = sorted(m.name for m in methods() if not m.probe_refusal)
        raise ValueError(
            f"probe: method must be one of {probed}, got {method.name!r} ({method.probe_refusal})"
        )
    if method.paired and rollouts % 2:
        raise ValueError(f"probe: {method.name} noise pairs (+eps, -eps); use an even number of rollouts")
    sigmas = [float(s) for s in sigmas]
    if any(not (math.isfinite(s) and s >= 0) for s in sigmas):
        raise ValueError(f"probe: every sigma must be a finite number >= 0, got {sigmas}")
    repeated = sorted({s for s in sigmas if sigmas.count(s) > 1})
    if repeated:
        raise ValueError(
            f"probe: sigma {repeated[0]:g} is given twice ({', '.join(f'{s:g}' for s in sigmas)}); each sigma is "
            "probed once: give every value once"
        )
    if not temperature > 0:
        raise ValueError(f"probe: temperature must be > 0, got {temperature}")
    if marginal_draws < 2 or marginal_draws % 2:
        raise ValueError(
            f"probe: marginal_draws must be an even number >= 2 (the estimate's draws are antithetic pairs), "
            f"got {marginal_draws}"
        )
    if target_marginal_tv is not None:
        if not (math.isfinite(target_marginal_tv) and 0 < target_marginal_tv < 1):
            raise ValueError(f"probe: target_marginal_tv must be in (0, 1), got {target_marginal_tv}")
        if site != "final_norm":
            raise ValueError(
                "probe: target_marginal_tv needs the final-norm site, where q_bar is computed through the "
                "LM head alone; at a layer site every draw is a forward pass (probe a few sigmas instead)"
            )
    return sigmas


#: Host bytes per Monte Carlo draw of one prompt's marginal besides its eps, state and first-token
#: distributions: the draw's noise key (a Python object).
_BYTES_PER_DRAW = 256
#: Bytes per vocabulary entry of one draw while a prompt's estimate is made: its logits and distribution
#: (float32), then the distribution, its difference from q, the control variate and the jackknife's
#: held-out means (float64; :func:`ncgrpo.core.marginal.estimate_marginal_tv`).
_BYTES_PER_DRAW_TOKEN = 2 * 4 + 5 * 8


def _check_marginal_memory(model: Any, prompts: int, draws: int, device: torch.device) -> None:
    """Refuse, before anything is allocated, ``marginal_draws`` the marginal estimate cannot hold: the eps
    of every prompt are kept (``prompts x marginal_draws x d`` float32) and each prompt's draws become
    ``marginal_draws x V`` first-token distributions (float32, then float64) with the estimator's terms.
    ``probe --marginal_draws 50000000`` grew to 23.7 GB and ended in the OOM killer or an internal error."""

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = int(getattr(text, "hidden_size", 0) or 0)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    V = int(head.weight.shape[0]) if head is not None else int(getattr(text, "vocab_size", 0) or 0)
    need = draws * (prompts * d * 8 + V * _BYTES_PER_DRAW_TOKEN + _BYTES_PER_DRAW)
    have = models.available_memory()
    what = (
        f"{prompts} prompts x {draws} draws x d={d} float32 eps and states, and per prompt {draws} first-token "
        f"distributions over V={V} tokens with the estimator's terms"
    )
    if have is not None and need > have:
        raise ValueError(
            f"marginal_draws {draws}: the noise-averaged first-token estimate would hold ~{need / 1e9:.1f} GB "
            f"({what}), more than the {have / 1e9:.1f} GB of memory available; lower marginal_draws (default "
            f"1024; the Monte Carlo error shrinks as 1/sqrt(draws)) or the prompts"
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        on_device = draws * V * 4  # one prompt's draws' distributions, gathered on the device
        if on_device > free:
            raise ValueError(
                f"marginal_draws {draws}: one prompt's {draws} first-token distributions over V={V} tokens take "
                f"~{on_device / 1e9:.1f} GB on {device}, more than its {free / 1e9:.1f} GB free; lower "
                "marginal_draws (default 1024)"
            )


@dataclass
class _Clean:
    """One chunk's clean pass: what every sigma's noisy pass is compared with."""

    inputs: dict
    pids: list[int]  # the prompts' noise ids
    sample: dict[str, Any]  # _sample's settings, the chunk's sampler seed included
    ids: list[list[int]]
    probs: torch.Tensor  # [B, V] clean first-token distribution at the sampling temperature
    rewards: list[float]
    answers: list[Any]
    choices: list[Any]
    types: list[Any]
    questions: list[Question]  # each prompt's question, once per rollout


@dataclass
class _Pass:
    """One :func:`probe` call's settings and what its sampling pass gathers, prompt by prompt."""

    model: Any  # unwrapped, in eval mode
    processor: Any
    proc: Any  # the processor with the branch prefix
    sigmas: list[float]
    R: int
    seed: int
    method: RolloutMethod
    branch_prefix: str
    temperature: float
    marginal_draws: int
    final_norm: bool
    sample: dict[str, Any]  # _sample's settings but the seed
    reward: Any = None  # (questions, completion texts) -> rewards; None: math_reward on the answers
    head: Any = None
    bar: Any = None
    ent: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    clean_first: list[torch.Tensor] = field(
        default_factory=list
    )  # one clean first-token logit row per prompt
    # final-norm site: per prompt, its noise-averaged first-token TV as a function of sigma (its draws
    # common to every sigma: common random numbers)
    curves: list[MarginalCurve] = field(default_factory=list)
    qids: list[str] = field(default_factory=list)
    acc: dict[float, dict[str, list]] = field(default_factory=dict)
    vocab: int = 0

    def __post_init__(self) -> None:
        self.head = find_text_stack(self.model)[0].lm_head
        self.acc = {
            s: {"tv": [], "flip": [], "changed": [], "first": [], "rel": [], "diff": [], "rc": [], "rn": [],
                "marginal": [], "qbar": []}
            for s in self.sigmas
        }  # fmt: skip

    def _tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def chunk(self, c: int, qs: list[Question], device: torch.device) -> None:
        """The clean pass over one chunk of prompts, then one noisy pass per sigma."""
        clean = self._clean(c, qs, device)
        for s in self.sigmas:
            self._noisy(s, qs, clean)

    def _clean(self, c: int, qs: list[Question], device: torch.device) -> _Clean:
        R, temperature = self.R, self.temperature
        inputs = _inputs(self.proc, qs, R, device)
        pids = []
        for p in range(len(qs)):
            m = inputs["attention_mask"][p * R].bool()
            pids.append(prompt_noise_id(inputs["input_ids"][p * R][m].tolist(), qs[p].images))
        sample_seed = noise_seed("probe-sample", self.seed, c)
        kw = dict(seed=sample_seed, **self.sample)
        clean_ids, clean_logits, _, clean_h = _sample(self.model, inputs, [RowNoise()] * (len(qs) * R), **kw)
        self._tick()
        self.vocab = int(clean_logits.shape[-1])
        self.qids += [str(q.question_id) for q in qs]
        if self.final_norm:
            for p, pid in enumerate(pids):
                self.curves.append(
                    MarginalCurve(
                        self.head, clean_h[p * R][None], clean_logits[p * R][None],
                        marginal_keys(self.seed, 0, pid, self.marginal_draws // 2), temperature=self.temperature,
                        mode=self.method.noise_mode or "independent",
                    )
                )  # fmt: skip
        p_clean = torch.softmax(clean_logits / temperature, -1)  # [B, V]
        H = -(p_clean * torch.log(p_clean.clamp_min(1e-30))).sum(-1)
        self.ent += H[::R].tolist()
        self.clean_first.append(clean_logits[::R].detach().float().cpu())
        self.top1 += p_clean.max(-1).values[::R].tolist()
        answers = [q.answer for q in qs for _ in range(R)]
        choices = [q.choices for q in qs for _ in range(R)]
        types = [q.answer_type for q in qs for _ in range(R)]
        tok = tokenizer_of(self.processor)
        texts_clean = prefix_completions(
            tok.batch_decode(clean_ids, skip_special_tokens=True), self.branch_prefix
        )
        rows_q = [q for q in qs for _ in range(R)]
        r_clean = self._reward(rows_q, texts_clean)
        return _Clean(inputs, pids, kw, clean_ids, p_clean, r_clean, answers, choices, types, rows_q)

    def _reward(self, questions: list[Question], texts: list[str]) -> list[float]:
        if self.reward is not None:
            return list(self.reward(questions, texts))
        answers = [q.answer for q in questions]
        choices = [q.choices for q in questions]
        types = [q.answer_type for q in questions]
        return math_reward(texts, answer=answers, choices=choices, answer_type=types)

    def _noisy(self, s: float, qs: list[Question], clean: _Clean) -> None:
        R, temperature, seed, method = self.R, self.temperature, self.seed, self.method
        p_clean, clean_ids, r_clean = clean.probs, clean.ids, clean.rewards
        rows = [r for pid in clean.pids for r in plan_group(R, s, seed, 0, pid, method)[R:]]  # the noisy half
        ids, logits, rel, _ = _sample(self.model, clean.inputs, rows, **clean.sample)
        self._tick()
        q_noisy = torch.softmax(logits / temperature, -1)
        a = self.acc[s]
        for p in range(len(qs)):
            i = len(a["marginal"])
            if self.final_norm:  # the shared estimator (antithetic draws, control variate)
                curve = self.curves[i]
                found = curve(s)
                est = as_estimate(found, curve.p, 0, curve.draws)
                a["qbar"].append(found.qbar[0].float())
            else:  # the rollouts' own draws: every one a forward pass
                draws = q_noisy[p * R : (p + 1) * R]
                est = marginal_estimate(p_clean[p * R], draws, paired=method.noise_mode == "antithetic")
                a["qbar"].append(draws.mean(0))
            a["marginal"].append(est)
        a["tv"] += (0.5 * (q_noisy - p_clean).abs().sum(-1)).tolist()
        a["flip"] += (q_noisy.argmax(-1) != p_clean.argmax(-1)).float().tolist()
        a["changed"] += [float(x != y) for x, y in zip(ids, clean_ids, strict=True)]
        a["first"] += [float(x[:1] != y[:1]) for x, y in zip(ids, clean_ids, strict=True)]
        a["rel"] += rel.tolist()
        tok = tokenizer_of(self.processor)
        texts = prefix_completions(tok.batch_decode(ids, skip_special_tokens=True), self.branch_prefix)
        r_noisy = self._reward(clean.questions, texts)
        a["rc"] += r_clean
        a["rn"] += r_noisy
        for p in range(len(qs)):
            sl = slice(p * R, (p + 1) * R)
            a["diff"].append(sum(r_noisy[sl]) / R - sum(r_clean[sl]) / R)

    def row(self, s: float, logits_all: torch.Tensor, n_questions: int) -> SigmaProbe:
        """The figures at one sigma, from what the passes gathered."""
        R, temperature = self.R, self.temperature
        a = self.acc[s]
        tv, changed = _mean(a["tv"]), _mean(a["changed"])
        ests = a["marginal"]
        m_tv = _mean([e.tv for e in ests])
        m_se = math.sqrt(sum(e.tv_se**2 for e in ests if math.isfinite(e.tv_se))) / len(ests)
        half = t_quantile(min(e.units for e in ests)) * m_se
        per_draw_tv = [float(x) for x in torch.tensor(a["tv"]).view(n_questions, R).mean(1)]  # per prompt
        eq_t = closest_temperature(logits_all, torch.stack(a["qbar"])) if s > 0 else float(temperature)
        matched = match_first_token_temperature(logits_all, min(max(m_tv, 0.0), 1.0), temperature=temperature)
        matched_draw = match_first_token_temperature(
            logits_all, min(max(tv, 0.0), 1.0), temperature=temperature
        )
        per_prompt = [
            {
                "question_id": self.qids[i],
                "entropy": round(self.ent[i], 6),
                "tv": round(per_draw_tv[i], 6),
                "marginal_tv": round(e.tv, 6),
                "marginal_tv_se": round(e.tv_se, 6),
                "marginal_kl": round(e.kl, 8),
            }
            for i, e in enumerate(ests)
        ]
        return SigmaProbe(
            sigma=s,
            tv=round(tv, 6),
            marginal_tv=round(m_tv, 6),
            marginal_tv_se=round(m_se, 6),
            marginal_tv_ci95=round(half, 6),
            marginal_kl=round(_mean([e.kl for e in ests]), 8),
            equivalent_temperature=round(eq_t, 4),
            flip=round(_mean(a["flip"]), 6),
            changed=round(changed, 6),
            first_changed=round(_mean(a["first"]), 6),
            rel=round(_mean(a["rel"]), 6),
            reward_clean=round(_mean(a["rc"]), 6),
            reward_noisy=round(_mean(a["rn"]), 6),
            p_value=round(_paired_p(a["diff"]), 6),
            n_prompts=n_questions,
            n_rollouts=len(a["changed"]),
            verdict=verdict(s, m_tv, eq_t if s > 0 else None),
            matched_temperature=round(matched, 4),
            matched_temperature_per_draw=round(matched_draw, 4),
            marginal_draws=self.marginal_draws if self.final_norm else R,
            per_prompt=per_prompt,
        )

    def target_sigma(self, target_marginal_tv: float) -> float | None:
        """The sigma whose marginal TV reaches ``target_marginal_tv`` (final-norm site): the trainer's solver
        (:func:`~ncgrpo.core.marginal.solve_sigma_for_marginal_tv`) on the mean of the prompts' curves (the
        estimator of ``marginal_tv``, the same draws at every sigma). None: not
        reached even at :data:`TARGET_SIGMA_MAX`."""

        def tv_at(sigma: float) -> float:
            return _mean([float(curve(sigma).tv[0]) for curve in self.curves])

        found = solve_sigma_for_marginal_tv(
            tv_at, target_marginal_tv, start=self.sigmas[0] or 0.2, sigma_max=TARGET_SIGMA_MAX
        )
        return None if found.at_max else round(found.sigma, 5)


def probe(
    model: Any,
    processor: Any,
    questions: Sequence[Question],
    sigmas: Sequence[float] = (0.2,),
    *,
    rollouts: int = 4,
    site: Site = "final_norm",
    layer_decay: float = 0.5,
    branch_prefix: str = "",
    method: str | RolloutMethod = "latent",
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 8,
    seed: int = 0,
    model_name: str = "",
    progress: bool = True,
    marginal_draws: int = 1024,
    target_marginal_tv: float | None = None,
    share_prompt_prefill: bool = True,
    reward: Callable[[list[Question], list[str]], list[float]] | None = None,
) -> ProbeResult:
    """Measure what the prefill noise does to first tokens and rollouts (module docstring).

    ``questions``: the prompts (every one is used; slice beforehand). ``rollouts``: sampled rollouts
    per prompt and sigma (and as many clean partners); ``method``: the hidden-noise method whose draws
    are probed (a registered name or method, :mod:`ncgrpo.methods`, whose ``probe_refusal`` is None:
    ``latent``, ``antithetic`` or ``spsa`` among the built-ins; the paired ones need an even ``rollouts``).
    ``batch_size``: prompts per generate call (rows = ``batch_size * rollouts``).
    ``marginal_draws``: Monte Carlo draws of eps per prompt behind ``marginal_tv`` at the final-norm
    site (through the LM head only; the eps of every prompt are kept for the target search:
    ``prompts x marginal_draws x d`` floats). ``target_marginal_tv``: also find the sigma whose marginal
    TV reaches this value (final-norm site only). ``share_prompt_prefill``: each prompt's vision tower
    and prompt minus its last token run once for its rows
    (:func:`ncgrpo.engines.shared_prefill.shared_prefill_generate`; not at layer sites).
    ``reward``: the rollouts' reward, ``(questions, completion texts) -> rewards`` with one question per
    completion (:func:`ncgrpo.rewards.loading.question_rewards` calls reward functions as TRL does);
    None: :data:`ncgrpo.rewards.math_reward` on each question's answer.

    The steps: the settings' checks (:func:`_check_settings`); per chunk of ``batch_size`` prompts, a
    clean pass and one noisy pass per sigma with the same sampler seed (:meth:`_Pass.chunk`); the
    figures per sigma (:meth:`_Pass.row`); the target search (:meth:`_Pass.target_sigma`).
    """
    method = get_method(method)
    sigmas = _check_settings(
        questions, sigmas, rollouts=rollouts, site=site, method=method, temperature=temperature,
        marginal_draws=marginal_draws, target_marginal_tv=target_marginal_tv,
    )  # fmt: skip
    t0 = time.perf_counter()
    gen_model = unwrap_model(model)
    was_training = gen_model.training
    gen_model.eval()
    device = next(gen_model.parameters()).device
    if site == "final_norm":
        _check_marginal_memory(gen_model, len(questions), marginal_draws, device)
    sample = dict(
        site=site,
        layer_decay=layer_decay,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        pad_id=tokenizer_of(processor).pad_token_id,
        share_prompt_prefill=share_prompt_prefill,
    )
    run = _Pass(
        model=gen_model, processor=processor, proc=with_branch_prefix(processor, branch_prefix),
        sigmas=sigmas, R=rollouts, seed=seed, method=method, branch_prefix=branch_prefix, temperature=temperature,
        marginal_draws=marginal_draws, final_norm=site == "final_norm", sample=sample, reward=reward,
    )  # fmt: skip
    chunks = [list(questions[i : i + batch_size]) for i in range(0, len(questions), batch_size)]
    if progress:
        run.bar = tqdm(total=len(chunks) * (1 + len(sigmas)), desc="probe", unit="call")
    try:
        for c, qs in enumerate(chunks):
            run.chunk(c, qs, device)
    finally:
        if run.bar is not None:
            run.bar.close()
        gen_model.train(was_training)

    result = ProbeResult(
        model=model_name or str(getattr(getattr(gen_model, "config", None), "_name_or_path", "")),
        site=str(site),
        branch_prefix=branch_prefix,
        method=method.name,
        n_prompts=len(questions),
        rollouts=rollouts,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        entropy=round(_mean(run.ent), 6),
        entropy_max=round(math.log(run.vocab), 4),
        top1=round(_mean(run.top1), 6),
    )
    logits_all = torch.cat(run.clean_first)  # [N, V]
    result.rows = [run.row(s, logits_all, len(questions)) for s in sigmas]
    if target_marginal_tv is not None:
        result.target_marginal_tv = target_marginal_tv
        result.target_sigma = run.target_sigma(target_marginal_tv)
    result.wall_s = round(time.perf_counter() - t0, 2)
    result.provenance = provenance()
    return result
