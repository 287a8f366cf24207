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
  reward, :data:`ncgrpo.rewards.math_reward`, on the completion with the branch prefix in front) and
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

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ncgrpo.core.agreement import match_first_token_temperature
from ncgrpo.core.marginal import (
    branch_eps,
    closest_temperature,
    marginal_estimate,
    marginal_keys,
    noisy_probs,
    sigma_for_marginal_tv,
)
from ncgrpo.core.noise import RowNoise, noise_seed
from ncgrpo.core.plan import HIDDEN_NOISE_METHODS, NOISE_MODE, plan_group, prompt_noise_id
from ncgrpo.data.prompts import build_messages
from ncgrpo.data.types import Question
from ncgrpo.engines.transformers import (
    Site,
    branch_point_capture,
    cut_after_eos,
    eos_token_ids,
    find_text_stack,
    prefill_noise,
    unwrap_model,
)
from ncgrpo.engines.transformers import (
    share_prompt_prefill as sharing,  # the parameter of that name says whether to share
)
from ncgrpo.models import tokenizer_of
from ncgrpo.trainer.prefix import prefix_completions, with_branch_prefix
from ncgrpo.rewards import math_reward

__all__ = ["INERT_BELOW", "LIVE_FROM", "ProbeResult", "SigmaProbe", "format_probe", "probe", "verdict"]

#: the largest sigma ``target_marginal_tv`` searches
TARGET_SIGMA_MAX = 4.0
#: below this marginal first-token TV the noise is called inert; from LIVE_FROM on, live.
INERT_BELOW = 0.002
LIVE_FROM = 0.02


@dataclass
class SigmaProbe:
    """The probe's figures at one noise scale (means over prompts x rollouts unless said otherwise)."""

    sigma: float
    tv: float  # mean per-draw TV(q, q_eps)
    marginal_tv: float  # TV(q, q_bar), mean over prompts
    marginal_tv_se: float  # its Monte Carlo standard error
    marginal_kl: float  # KL(q_bar || q), nats, mean over prompts
    equivalent_temperature: float  # the temperature whose first-token distribution is closest to q_bar
    flip: float
    changed: float
    first_changed: float
    rel: float  # measured ||h~ - h|| / ||h|| at the site (noisy rows)
    reward_clean: float
    reward_noisy: float
    p_value: float
    n_prompts: int
    n_rollouts: int
    verdict: str = ""
    #: the first-token temperature T0 whose mean first-token TV on these prompts equals ``marginal_tv``:
    #: the matched control's starting value (``first_token_temperature``) for this sigma
    matched_temperature: float = float("nan")
    #: the older calibration, T0 whose TV equals the per-draw ``tv`` (moves rollouts far more than the noise)
    matched_temperature_per_draw: float = float("nan")
    #: marginal draws per prompt behind ``marginal_tv`` (final-norm site), or the rollouts (layer sites)
    marginal_draws: int = 0
    per_prompt: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ProbeResult:
    """What :func:`probe` measured. ``rows``: one :class:`SigmaProbe` per sigma, in the order given."""

    model: str
    site: str
    branch_prefix: str
    method: str
    n_prompts: int
    rollouts: int
    temperature: float
    max_new_tokens: int
    seed: int
    entropy: float  # mean clean first-token entropy, nats
    entropy_max: float
    top1: float  # mean clean probability of the argmax first token
    rows: list[SigmaProbe] = field(default_factory=list)
    wall_s: float = 0.0
    #: with ``target_marginal_tv``: the sigma whose marginal TV reaches it (final-norm site)
    target_marginal_tv: float | None = None
    target_sigma: float | None = None

    @property
    def verdict(self) -> str:
        """One line per non-zero sigma, joined by '; '."""
        lines = [r.verdict for r in self.rows if r.sigma > 0]
        return "; ".join(lines) if lines else "no sigma > 0 probed"

    @property
    def live(self) -> bool:
        return any(r.verdict.startswith("live") for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        return text


def verdict(sigma: float, marginal_tv: float, temperature: float | None = None) -> str:
    """``"weak at sigma 0.2: noise-averaged first-token TV 0.0068 (like temperature 1.02)"``, inert or live.

    Decided on the marginal ``TV(q, q_bar)`` (what generates the noisy rollouts), not on per-draw
    figures."""
    state = "inert" if marginal_tv < INERT_BELOW else ("weak" if marginal_tv < LIVE_FROM else "live")
    like = f" (like first-token temperature {temperature:.3g})" if temperature is not None else ""
    return f"{state} at sigma {sigma:g}: noise-averaged first-token TV {marginal_tv:.4f}{like}"


def _inputs(processor: Any, questions: Sequence[Question], repeat: int, device: torch.device) -> dict:
    """Left-padded model inputs for ``questions``, each row repeated ``repeat`` times (prompt-major)."""
    texts = [
        processor.apply_chat_template(build_messages(q), add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
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
    from scipy import stats

    p = float(stats.ttest_rel([0.0] * len(diffs), list(diffs)).pvalue)
    return 1.0 if math.isnan(p) else p


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
    method: str = "latent",
    temperature: float = 1.0,
    max_new_tokens: int = 48,
    batch_size: int = 8,
    seed: int = 0,
    model_name: str = "",
    progress: bool = True,
    marginal_draws: int = 1024,
    target_marginal_tv: float | None = None,
    share_prompt_prefill: bool = True,
) -> ProbeResult:
    """Measure what the prefill noise does to first tokens and rollouts (module docstring).

    ``questions``: the prompts (every one is used; slice beforehand). ``rollouts``: sampled rollouts
    per prompt and sigma (and as many clean partners); ``method``: the hidden-noise method whose draws
    are probed (``latent``, ``antithetic`` or ``spsa``; the paired ones need an even ``rollouts``).
    ``batch_size``: prompts per generate call (rows = ``batch_size * rollouts``).
    ``marginal_draws``: Monte Carlo draws of eps per prompt behind ``marginal_tv`` at the final-norm
    site (through the LM head only; the eps of every prompt are kept for the target search:
    ``prompts x marginal_draws x d`` floats). ``target_marginal_tv``: also find the sigma whose marginal
    TV reaches this value (final-norm site only). ``share_prompt_prefill``: each prompt's vision tower
    and prompt minus its last token run once for its rows
    (:func:`ncgrpo.engines.transformers.shared_prefill_generate`; not at layer sites).
    """
    if not questions:
        raise ValueError("probe: no questions")
    if rollouts < 1:
        raise ValueError(f"probe: rollouts must be >= 1, got {rollouts}")
    if method not in HIDDEN_NOISE_METHODS:
        raise ValueError(f"probe: method must be one of {sorted(HIDDEN_NOISE_METHODS)}, got {method!r}")
    if method != "latent" and rollouts % 2:
        raise ValueError(f"probe: {method} noise pairs (+eps, -eps); use an even number of rollouts")
    sigmas = [float(s) for s in sigmas]
    if any(not (math.isfinite(s) and s >= 0) for s in sigmas):
        raise ValueError(f"probe: every sigma must be a finite number >= 0, got {sigmas}")
    if not temperature > 0:
        raise ValueError(f"probe: temperature must be > 0, got {temperature}")
    if marginal_draws < 2:
        raise ValueError(f"probe: marginal_draws must be >= 2, got {marginal_draws}")
    final_norm = site == "final_norm"
    if target_marginal_tv is not None:
        if not (math.isfinite(target_marginal_tv) and 0 < target_marginal_tv < 1):
            raise ValueError(f"probe: target_marginal_tv must be in (0, 1), got {target_marginal_tv}")
        if not final_norm:
            raise ValueError(
                "probe: target_marginal_tv needs the final-norm site, where q_bar is computed through the "
                "LM head alone; at a layer site every draw is a forward pass (probe a few sigmas instead)"
            )
    t0 = time.perf_counter()
    proc = with_branch_prefix(processor, branch_prefix)
    gen_model = unwrap_model(model)
    was_training = gen_model.training
    gen_model.eval()
    device = next(gen_model.parameters()).device
    pad_id = tokenizer_of(processor).pad_token_id
    R = rollouts
    chunks = [list(questions[i : i + batch_size]) for i in range(0, len(questions), batch_size)]

    ent, top1 = [], []
    clean_first: list[torch.Tensor] = []  # one clean first-token logit row per prompt
    # final-norm site: per prompt, the clean branch-point state and its marginal draws (common to every
    # sigma: common random numbers)
    branch_h: list[torch.Tensor] = []
    prompt_eps: list[torch.Tensor] = []
    qids: list[str] = []
    head = find_text_stack(gen_model)[0].lm_head
    mode = NOISE_MODE[method]
    acc = {
        s: {"tv": [], "flip": [], "changed": [], "first": [], "rel": [], "diff": [], "rc": [], "rn": [],
            "marginal": [], "qbar": []}
        for s in sigmas
    }  # fmt: skip
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chunks) * (1 + len(sigmas)), desc="probe", unit="call")
    try:
        for c, qs in enumerate(chunks):
            inputs = _inputs(proc, qs, R, device)
            pids = []
            for p in range(len(qs)):
                m = inputs["attention_mask"][p * R].bool()
                pids.append(prompt_noise_id(inputs["input_ids"][p * R][m].tolist(), qs[p].images))
            sample_seed = noise_seed("probe-sample", seed, c)
            kw = dict(
                seed=sample_seed,
                site=site,
                layer_decay=layer_decay,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                pad_id=pad_id,
                share_prompt_prefill=share_prompt_prefill,
            )
            clean_ids, clean_logits, _, clean_h = _sample(
                gen_model, inputs, [RowNoise()] * (len(qs) * R), **kw
            )
            if bar is not None:
                bar.update(1)
            qids += [str(q.question_id) for q in qs]
            if final_norm:
                for p, pid in enumerate(pids):
                    branch_h.append(clean_h[p * R])
                    keys = marginal_keys(seed, 0, pid, marginal_draws)
                    prompt_eps.append(branch_eps(keys, clean_h.shape[-1], mode))
            p_clean = torch.softmax(clean_logits / temperature, -1)  # [B, V]
            H = -(p_clean * torch.log(p_clean.clamp_min(1e-30))).sum(-1)
            ent += H[::R].tolist()
            clean_first.append(clean_logits[::R].detach().float().cpu())
            top1 += p_clean.max(-1).values[::R].tolist()
            answers = [q.answer for q in qs for _ in range(R)]
            choices = [q.choices for q in qs for _ in range(R)]
            types = [q.answer_type for q in qs for _ in range(R)]
            tok = tokenizer_of(processor)
            texts_clean = prefix_completions(
                tok.batch_decode(clean_ids, skip_special_tokens=True), branch_prefix
            )
            r_clean = math_reward(texts_clean, answer=answers, choices=choices, answer_type=types)
            for s in sigmas:
                rows = [
                    r for pid in pids for r in plan_group(R, s, seed, 0, pid, method)[R:]
                ]  # the noisy half
                ids, logits, rel, _ = _sample(gen_model, inputs, rows, **kw)
                if bar is not None:
                    bar.update(1)
                q_noisy = torch.softmax(logits / temperature, -1)
                a = acc[s]
                for p in range(len(qs)):
                    if final_norm:
                        draws = noisy_probs(
                            head, branch_h[len(a["marginal"])], prompt_eps[len(a["marginal"])], s,
                            temperature=temperature,
                        ).cpu()  # fmt: skip
                    else:  # the rollouts' own draws: every one a forward pass
                        draws = q_noisy[p * R : (p + 1) * R]
                    est = marginal_estimate(
                        p_clean[p * R], draws, seed=noise_seed("probe-boot", seed, len(a["marginal"]))
                    )
                    a["marginal"].append(est)
                    a["qbar"].append(draws.mean(0))
                a["tv"] += (0.5 * (q_noisy - p_clean).abs().sum(-1)).tolist()
                a["flip"] += (q_noisy.argmax(-1) != p_clean.argmax(-1)).float().tolist()
                a["changed"] += [float(x != y) for x, y in zip(ids, clean_ids, strict=True)]
                a["first"] += [float(x[:1] != y[:1]) for x, y in zip(ids, clean_ids, strict=True)]
                a["rel"] += rel.tolist()
                texts = prefix_completions(tok.batch_decode(ids, skip_special_tokens=True), branch_prefix)
                r_noisy = math_reward(texts, answer=answers, choices=choices, answer_type=types)
                a["rc"] += r_clean
                a["rn"] += r_noisy
                for p in range(len(qs)):
                    sl = slice(p * R, (p + 1) * R)
                    a["diff"].append(sum(r_noisy[sl]) / R - sum(r_clean[sl]) / R)
    finally:
        if bar is not None:
            bar.close()
        gen_model.train(was_training)

    def mean(xs: list[float]) -> float:
        return float(sum(xs) / len(xs)) if xs else float("nan")

    vocab = int(clean_logits.shape[-1])
    result = ProbeResult(
        model=model_name or str(getattr(getattr(gen_model, "config", None), "_name_or_path", "")),
        site=str(site),
        branch_prefix=branch_prefix,
        method=method,
        n_prompts=len(questions),
        rollouts=R,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
        entropy=round(mean(ent), 6),
        entropy_max=round(math.log(vocab), 4),
        top1=round(mean(top1), 6),
    )
    logits_all = torch.cat(clean_first)  # [N, V]
    for s in sigmas:
        a = acc[s]
        tv, changed = mean(a["tv"]), mean(a["changed"])
        ests = a["marginal"]
        m_tv = mean([e.tv for e in ests])
        m_se = math.sqrt(sum(e.tv_se**2 for e in ests if math.isfinite(e.tv_se))) / len(ests)
        per_draw_tv = [float(x) for x in torch.tensor(a["tv"]).view(len(questions), R).mean(1)]  # per prompt
        eq_t = closest_temperature(logits_all, torch.stack(a["qbar"])) if s > 0 else float(temperature)
        matched = match_first_token_temperature(logits_all, min(max(m_tv, 0.0), 1.0), temperature=temperature)
        matched_draw = match_first_token_temperature(
            logits_all, min(max(tv, 0.0), 1.0), temperature=temperature
        )
        per_prompt = [
            {
                "question_id": qids[i],
                "entropy": round(ent[i], 6),
                "tv": round(per_draw_tv[i], 6),
                "marginal_tv": round(e.tv, 6),
                "marginal_tv_se": round(e.tv_se, 6),
                "marginal_kl": round(e.kl, 8),
            }
            for i, e in enumerate(ests)
        ]
        result.rows.append(
            SigmaProbe(
                sigma=s,
                tv=round(tv, 6),
                marginal_tv=round(m_tv, 6),
                marginal_tv_se=round(m_se, 6),
                marginal_kl=round(mean([e.kl for e in ests]), 8),
                equivalent_temperature=round(eq_t, 4),
                flip=round(mean(a["flip"]), 6),
                changed=round(changed, 6),
                first_changed=round(mean(a["first"]), 6),
                rel=round(mean(a["rel"]), 6),
                reward_clean=round(mean(a["rc"]), 6),
                reward_noisy=round(mean(a["rn"]), 6),
                p_value=round(_paired_p(a["diff"]), 6),
                n_prompts=len(questions),
                n_rollouts=len(a["changed"]),
                verdict=verdict(s, m_tv, eq_t if s > 0 else None),
                matched_temperature=round(matched, 4),
                matched_temperature_per_draw=round(matched_draw, 4),
                marginal_draws=marginal_draws if final_norm else R,
                per_prompt=per_prompt,
            )
        )
    if target_marginal_tv is not None:
        p_all = torch.softmax(logits_all / temperature, -1)

        def tv_at(sigma: float) -> float:
            # the same estimator as marginal_tv, with the same draws and bootstrap resamples at every sigma
            return mean(
                [
                    marginal_estimate(
                        p, noisy_probs(head, h, e, sigma, temperature=temperature).cpu(), bootstrap=50, seed=i
                    ).tv
                    for i, (h, e, p) in enumerate(zip(branch_h, prompt_eps, p_all, strict=True))
                ]
            )

        result.target_marginal_tv = target_marginal_tv
        found = sigma_for_marginal_tv(tv_at, target_marginal_tv, hi=TARGET_SIGMA_MAX)
        # None: not reached even at TARGET_SIGMA_MAX
        result.target_sigma = None if found >= TARGET_SIGMA_MAX else round(found, 5)
    result.wall_s = round(time.perf_counter() - t0, 2)
    return result


def format_probe(result: ProbeResult) -> Any:
    """A rich renderable (table + verdict) for the terminal; ``rich.console.Console().print`` it."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = (
        f"probe: {result.model or 'model'} | site {result.site} | prefix {result.branch_prefix!r} | "
        f"{result.n_prompts} prompts x {result.rollouts} rollouts | T={result.temperature:g}"
    )
    table = Table(title=title)
    for col in ("sigma", "rel", "marginal TV ± se", "KL(q̄||q)", "like T", "TV per draw", "argmax flips %",
                "first token changed %", "rollouts changed %", "reward clean", "reward noisy", "paired p",
                "matched T0", "verdict"):  # fmt: skip
        table.add_column(col, justify="left" if col == "verdict" else "right")
    for r in result.rows:
        table.add_row(
            f"{r.sigma:g}",
            f"{r.rel:.3f}",
            f"{r.marginal_tv:.4f} ± {r.marginal_tv_se:.4f}",
            f"{r.marginal_kl:.2e}",
            f"{r.equivalent_temperature:.3g}",
            f"{r.tv:.4f}",
            f"{100 * r.flip:.1f}",
            f"{100 * r.first_changed:.1f}",
            f"{100 * r.changed:.1f}",
            f"{r.reward_clean:.3f}",
            f"{r.reward_noisy:.3f}",
            f"{r.p_value:.3g}",
            f"{r.matched_temperature:.3g}",
            r.verdict.split(" ", 1)[0],
        )
    lines = [
        f"clean first-token entropy {result.entropy:.4f} nats (max {result.entropy_max:.2f}); "
        f"mean top-1 probability {result.top1:.4f}; {result.wall_s:.1f} s",
        "marginal TV = TV(q, q̄), q̄ the noise-averaged first-token distribution: what the noisy half's "
        "rollouts are sampled from (per-draw TV and 'changed' describe one draw, and overstate it). "
        "like T: the first-token temperature closest to q̄; matched T0: the first-token control's T0 with "
        "the same marginal TV",
        f"verdict: {result.verdict}",
    ]
    if result.target_marginal_tv is not None:
        lines.append(
            f"target: marginal TV {result.target_marginal_tv:g} is reached at sigma {result.target_sigma:g}"
            if result.target_sigma is not None
            else f"target: marginal TV {result.target_marginal_tv:g} is not reached at any sigma <= {TARGET_SIGMA_MAX:g}"
        )
    if not result.live and result.site == "final_norm":
        lines.append(
            "hint: at the final-norm site the noise acts only through the first token; if the model opens "
            "with a format token, set branch_prefix (e.g. '<think>') so the prefill ends where reasoning begins"
        )
    return Group(table, Text("\n".join(lines)))
