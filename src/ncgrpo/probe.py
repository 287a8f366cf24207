"""``ncgrpo probe``: does the prefill noise change anything, before a training run pays for it?

At the paper's site the displacement reaches only the first-token logits (section 3.1, "Where the
perturbation acts"). If the model's first token is (nearly) certain -- a format token such as
``<think>`` -- NC-GRPO samples exactly vanilla GRPO's rollouts. The probe measures that on ``N``
prompts, for each noise scale, at the configured site and ``branch_prefix``:

* ``entropy``: the clean first-token entropy (nats), at the sampling temperature;
* ``tv``: mean total-variation distance between the clean and the noisy first-token distributions;
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
* a verdict per scale: ``inert`` (< 1% of rollouts change), ``weak`` (< 5%) or ``live``.

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
from ncgrpo.core.noise import RowNoise, noise_seed
from ncgrpo.core.plan import HIDDEN_NOISE_METHODS, plan_group, prompt_noise_id
from ncgrpo.data.prompts import build_messages
from ncgrpo.data.types import Question
from ncgrpo.engines.transformers import Site, find_text_stack, prefill_noise, unwrap_model
from ncgrpo.prefix import prefix_completions, with_branch_prefix
from ncgrpo.rewards import math_reward

__all__ = ["INERT_BELOW", "LIVE_FROM", "ProbeResult", "SigmaProbe", "format_probe", "probe", "verdict"]

#: below this fraction of changed rollouts the noise is called inert; from LIVE_FROM on, live.
INERT_BELOW = 0.01
LIVE_FROM = 0.05


@dataclass
class SigmaProbe:
    """The probe's figures at one noise scale (means over prompts x rollouts unless said otherwise)."""

    sigma: float
    tv: float
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
    #: the first-token temperature T0 whose mean first-token TV on these prompts equals ``tv``: the
    #: matched control's starting value (``first_token_temperature``) for this sigma
    matched_temperature: float = float("nan")


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


def verdict(sigma: float, changed: float, tv: float) -> str:
    """``"inert at sigma 0.2: 0.0% of rollouts change (first-token TV 0.0000)"``, or weak / live."""
    state = "inert" if changed < INERT_BELOW else ("weak" if changed < LIVE_FROM else "live")
    return f"{state} at sigma {sigma:g}: {100 * changed:.1f}% of rollouts change (first-token TV {tv:.4f})"


def _tokenizer(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _inputs(processor: Any, questions: Sequence[Question], repeat: int, device: torch.device) -> dict:
    """Left-padded model inputs for ``questions``, each row repeated ``repeat`` times (prompt-major)."""
    texts = [
        processor.apply_chat_template(build_messages(q), add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    rep = [t for t in texts for _ in range(repeat)]
    tok = _tokenizer(processor)
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
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """One seeded sampling call under the prefill hook.

    Returns (completion ids per row cut after the first EOS, first-token logits ``# [B, V]`` float32
    on the CPU as the sampler sees them before temperature, measured ``rel`` ``# [B]``)."""
    top = find_text_stack(model)[0]
    device = next(model.parameters()).device
    first: list[torch.Tensor] = []

    def capture(module, args, output):
        if not first:
            first.append(output[:, -1].detach().float().cpu())

    handle = top.lm_head.register_forward_hook(capture)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            with torch.no_grad(), prefill_noise(model, rows, site=site, layer_decay=layer_decay) as hook:
                out = model.generate(
                    **inputs,
                    do_sample=True,
                    temperature=temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                )
    finally:
        handle.remove()
    T = inputs["input_ids"].shape[1]
    eos = _eos_ids(model)
    ids = []
    for row in out[:, T:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        ids.append(row[:cut])
    return ids, first[0], hook.last.rel.float()


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
) -> ProbeResult:
    """Measure what the prefill noise does to first tokens and rollouts (module docstring).

    ``questions``: the prompts (every one is used; slice beforehand). ``rollouts``: sampled rollouts
    per prompt and sigma (and as many clean partners); ``method``: the hidden-noise method whose draws
    are probed (``latent``, ``antithetic`` or ``spsa``; the paired ones need an even ``rollouts``).
    ``batch_size``: prompts per generate call (rows = ``batch_size * rollouts``).
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
    t0 = time.perf_counter()
    proc = with_branch_prefix(processor, branch_prefix)
    gen_model = unwrap_model(model)
    was_training = gen_model.training
    gen_model.eval()
    device = next(gen_model.parameters()).device
    pad_id = _tokenizer(processor).pad_token_id
    R = rollouts
    chunks = [list(questions[i : i + batch_size]) for i in range(0, len(questions), batch_size)]

    ent, top1 = [], []
    clean_first: list[torch.Tensor] = []  # one clean first-token logit row per prompt
    acc = {
        s: {"tv": [], "flip": [], "changed": [], "first": [], "rel": [], "diff": [], "rc": [], "rn": []}
        for s in sigmas
    }
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
            )
            clean_ids, clean_logits, _ = _sample(gen_model, inputs, [RowNoise()] * (len(qs) * R), **kw)
            if bar is not None:
                bar.update(1)
            p_clean = torch.softmax(clean_logits / temperature, -1)  # [B, V]
            H = -(p_clean * torch.log(p_clean.clamp_min(1e-30))).sum(-1)
            ent += H[::R].tolist()
            clean_first.append(clean_logits[::R].detach().float().cpu())
            top1 += p_clean.max(-1).values[::R].tolist()
            answers = [q.answer for q in qs for _ in range(R)]
            choices = [q.choices for q in qs for _ in range(R)]
            types = [q.answer_type for q in qs for _ in range(R)]
            tok = _tokenizer(processor)
            texts_clean = prefix_completions(
                tok.batch_decode(clean_ids, skip_special_tokens=True), branch_prefix
            )
            r_clean = math_reward(texts_clean, answer=answers, choices=choices, answer_type=types)
            for s in sigmas:
                rows = [
                    r for pid in pids for r in plan_group(R, s, seed, 0, pid, method)[R:]
                ]  # the noisy half
                ids, logits, rel = _sample(gen_model, inputs, rows, **kw)
                if bar is not None:
                    bar.update(1)
                q_noisy = torch.softmax(logits / temperature, -1)
                a = acc[s]
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
    for s in sigmas:
        a = acc[s]
        tv, changed = mean(a["tv"]), mean(a["changed"])
        matched = match_first_token_temperature(
            torch.cat(clean_first), min(max(tv, 0.0), 1.0), temperature=temperature
        )
        result.rows.append(
            SigmaProbe(
                sigma=s,
                tv=round(tv, 6),
                flip=round(mean(a["flip"]), 6),
                changed=round(changed, 6),
                first_changed=round(mean(a["first"]), 6),
                rel=round(mean(a["rel"]), 6),
                reward_clean=round(mean(a["rc"]), 6),
                reward_noisy=round(mean(a["rn"]), 6),
                p_value=round(_paired_p(a["diff"]), 6),
                n_prompts=len(questions),
                n_rollouts=len(a["changed"]),
                verdict=verdict(s, changed, tv),
                matched_temperature=round(matched, 4),
            )
        )
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
    for col in ("sigma", "rel", "first-token TV", "argmax flips %", "first token changed %",
                "rollouts changed %", "reward clean", "reward noisy", "paired p", "matched T0", "verdict"):  # fmt: skip
        table.add_column(col, justify="left" if col == "verdict" else "right")
    for r in result.rows:
        table.add_row(
            f"{r.sigma:g}",
            f"{r.rel:.3f}",
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
        f"verdict: {result.verdict}",
    ]
    if not result.live and result.site == "final_norm":
        lines.append(
            "hint: at the final-norm site the noise acts only through the first token; if the model opens "
            "with a format token, set branch_prefix (e.g. '<think>') so the prefill ends where reasoning begins"
        )
    return Group(table, Text("\n".join(lines)))
