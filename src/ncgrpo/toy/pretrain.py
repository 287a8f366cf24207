"""The embedded base model: a tiny Qwen2.5-VL supervised-fine-tuned on the synthetic suite's traces.

The paper starts RL from Qwen2.5-VL-7B-Instruct, a model that already has general visual skills and
solves part of Geometry3K, and trains only on Geometry3K (section 4.1). The offline miniature needs a
base model in the same position, so ``ncgrpo demo`` and the tests can run the real Qwen2.5-VL code
paths (hidden-state hooks, the TRL trainer, the eval runner) from a fresh clone on a CPU:

* the architecture is ``Qwen2_5_VLForConditionalGeneration`` at toy scale (:data:`SIZES`), with a
  byte-level BPE tokenizer trained on :func:`ncgrpo.toy.traces.corpus` of the suite and the
  Qwen2.5-VL processor at the suite's 84 px image size (6 x 6 patches of 14 px, 9 merged image tokens);
* its vision tower and merger are first pre-trained for :data:`DEFAULT_VISION_WARMUP` steps on scene
  attributes of fresh images of every family (:func:`~ncgrpo.toy.vision_warmup.scene_targets`: a figure's corner count and
  written labels, which coloured shapes a scene holds and how many, which of two objects is bigger,
  each bar's height and colour; heads on the merged image tokens, discarded afterwards,
  :func:`~ncgrpo.toy.vision_warmup._vision_warmup`). Without this the SFT run learns the traces' text prior long before the
  random tower carries signal and the language model learns to ignore the image (measured: 14%
  greedy in-domain, "6 sides" for every figure, training loss unchanged when the images are
  shuffled). The tower is then frozen (:data:`DEFAULT_VISION_LR_SCALE` = 0): SFT through a trainable
  tower erased the colour-to-shape binding the warm-up had taught (a linear probe read the asked
  shape's colour 71% right after the warm-up, 22% after SFT);
* it is then supervised-fine-tuned on ``prompt -> warmup_trace(q)`` pairs, the prompt being exactly
  what training and evaluation feed the model (:func:`ncgrpo.data.prompts.build_messages` rendered by
  the processor's chat template with ``add_generation_prompt=True``), the loss on the completion
  tokens only (the trace and the closing ``<|im_end|>``);
* the SFT pool (:func:`~ncgrpo.toy.sft_data.sft_pool`) holds items of EVERY family (the base model's "general skills"),
  drawn from streams of their own and disjoint, by content hash, from every split of the suite it is
  evaluated on, so validation/test never leak and the RL train split stays unseen. Geometry (the
  in-domain family RL trains on) is only a share of the pool. With the frozen warm-up tower, 1,500
  items per out-of-domain family and :data:`DEFAULT_STEPS` mixed steps, the base reads compare,
  counting and bar-chart questions but gives one constant answer to colour and POPE questions, the two
  that ask which colour goes with which shape (the colour token's loss stays near ln 6 on its own
  training items, and more colour/POPE items in the mix did not change that);
* so SFT ends in a curriculum: :data:`DEFAULT_FOCUS_STEPS` steps on the colour and POPE items alone
  (:data:`DEFAULT_FOCUS_FAMILIES`), where the language model does learn to read the colour of the
  asked shape, then :data:`DEFAULT_FINAL_STEPS` mixed steps, which bring back what the focused phase
  made it forget while keeping that read; both at :data:`DEFAULT_LATE_LR` (README, "The base model per
  family", has the measurements);
* the in-domain traces open in four correct ways, and 30% of them take an image-blind shortcut
  instead (:func:`ncgrpo.toy.traces.shortcut_trace`: ``answer: 4.`` for every "how many sides"
  question). The base's greedy answer is that shortcut, right only when the figure happens to fit,
  while it also samples derivations that read the figure: greedy accuracy inside
  :data:`TARGET_BAND`, enough groups with mixed rewards (section 3: a group whose rewards are all
  equal has zero advantage, eq. 1), and a lesson GRPO can learn in a few dozen steps (prefer the
  derivation), decided at the first reasoning token, where the prefill noise acts.

The band is checked and reported (``PretrainReport.in_band``), never forced; the committed
checkpoint's ``pretrain.json`` records where the default recipe lands. The mixed phase's learning
rate is constant after warm-up, so its first k steps are exactly ``pretrain(steps=k)`` and one run
with snapshots (``on_step``) measures every mixed budget up to its length.
:func:`~ncgrpo.toy.base_model.ensure_base_model` returns the checkpoint committed as package data under
``src/ncgrpo/toy/assets/base`` when present, else builds one into a per-version cache.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

import ncgrpo
from ncgrpo.data.types import Question
from ncgrpo.processors import name_standard_processor
from ncgrpo.runs.folder import atomic_write_text
from ncgrpo.toy.model import (
    build_processor,
    build_tokenizer,
    count_parameters,
    save_tiny,
    tiny_qwen2_5_vl,
)
from ncgrpo.toy.sft_data import collate, encode_example, evaluate_base, sft_pool
from ncgrpo.toy.suite import build_suite, first_per_family
from ncgrpo.toy.synthetic import FAMILIES, IMAGE_SIZE
from ncgrpo.toy.traces import corpus
from ncgrpo.toy.vision_warmup import _vision_warmup

__all__ = [
    "ASSET_DIR",
    "DEFAULT_POOL",
    "DEFAULT_FINAL_STEPS",
    "DEFAULT_FOCUS_FAMILIES",
    "DEFAULT_FOCUS_STEPS",
    "DEFAULT_LATE_LR",
    "DEFAULT_STEPS",
    "MIXED_GROUP_TARGET",
    "PRETRAIN_FILE",
    "SIZES",
    "TARGET_BAND",
    "PretrainReport",
    "pretrain",
]

#: Greedy in-domain accuracy the base model should have: solves some, leaves room for RL. The lower
#: end is 10%: the shortcut's guesses are right on about 15% of in-domain questions.
TARGET_BAND = (0.10, 0.70)
#: Minimum share of in-domain prompts whose G sampled completions (T = 1) get mixed rewards.
MIXED_GROUP_TARGET = 0.30
PRETRAIN_FILE = "pretrain.json"
#: The committed checkpoint (package data), if any.
ASSET_DIR = Path(__file__).resolve().parent / "assets" / "base"

#: Model sizes: keyword overrides for :func:`ncgrpo.toy.model.tiny_qwen2_5_vl`, plus the tokenizer's
#: vocabulary size. "tiny" is the embedded base model; "micro" is for tests.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab_size=768,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_depth=2,
        vision_hidden_size=64,
        vision_intermediate_size=128,
        vision_num_heads=4,
    ),
    "micro": dict(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_depth=1,
        vision_hidden_size=32,
        vision_intermediate_size=32,
        vision_num_heads=2,
    ),
}
#: SFT pool: items per family. Geometry is the in-domain family RL later trains on.
DEFAULT_POOL: dict[str, int] = {
    "geometry": 2000,
    "counting": 1500,
    "bar_chart": 1500,
    "compare": 1500,
    "colour_choice": 1500,
    "pope": 1500,
}
DEFAULT_STEPS = 3000
#: After the mixed SFT phase: ``DEFAULT_FOCUS_STEPS`` steps on these families' pool items only, then
#: ``DEFAULT_FINAL_STEPS`` mixed steps again, both at ``DEFAULT_LATE_LR`` (see :func:`pretrain`).
DEFAULT_FOCUS_FAMILIES: tuple[str, ...] = ("colour_choice", "pope")
DEFAULT_FOCUS_STEPS = 2400
DEFAULT_FINAL_STEPS = 1000
DEFAULT_LATE_LR = 1e-3
#: Learning-rate multiplier of the vision tower and its patch merger relative to the language model
#: during SFT; 0 freezes them at what the vision warm-up taught (see :func:`~ncgrpo.toy.vision_warmup._vision_warmup`).
DEFAULT_VISION_LR_SCALE = 0.0
#: Steps of vision-tower pre-training on scene attributes before SFT (see :func:`~ncgrpo.toy.vision_warmup._vision_warmup`).
DEFAULT_VISION_WARMUP = 4000
#: Fresh scenes per vision warm-up step.
VISION_BATCH = 48


# ------------------------------------------------------------------------------------- training


@dataclass
class PretrainReport:
    """What :func:`pretrain` did and measured; written to ``OUT/pretrain.json``."""

    out_dir: str
    seed: int
    steps: int
    size: str
    dims: dict[str, int]
    batch_size: int
    lr: float
    pool: dict[str, int]
    parameters: dict[str, int]
    losses: list[float]  # mean completion-token loss of each step
    wall_time_s: float
    train_time_s: float
    eval_time_s: float | None = None
    accuracy: dict[str, float] = field(default_factory=dict)  # validation, greedy, per family
    sample_accuracy: dict[str, float] = field(default_factory=dict)
    mixed_share: dict[str, float] = field(default_factory=dict)  # in-domain groups with mixed rewards
    group_size: int | None = None
    eval_questions: dict[str, int] = field(default_factory=dict)
    eval_correct: dict[str, bool] = field(default_factory=dict)  # uid -> greedy correct
    target_band: tuple[float, float] = TARGET_BAND
    mixed_target: float = MIXED_GROUP_TARGET
    in_band: bool | None = None
    mixed_ok: bool | None = None
    checkpoint_bytes: int = 0
    suite_seed: int = 0
    num_threads: int = 0  # torch intra-op threads the run used (weights may depend on it)
    torch_version: str = ""
    transformers_version: str = ""
    ncgrpo_version: str = ""
    vision_lr_scale: float = 1.0  # learning-rate multiplier of the vision tower and merger
    vision_warmup_steps: int = 0  # steps of vision-tower pre-training before SFT
    vision_losses: list[float] = field(default_factory=list)  # its loss per step
    focus_families: list[str] = field(default_factory=list)  # the focused phase's families
    focus_steps: int = 0  # steps on their items only, after the mixed phase's ``steps``
    final_steps: int = 0  # mixed steps after the focused phase
    late_lr: float | None = None  # learning rate of the focused and final phases

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_band"] = list(self.target_band)
        return d

    @classmethod
    def load(cls, path: str | os.PathLike) -> PretrainReport:
        p = Path(path)
        if p.is_dir():
            p = p / PRETRAIN_FILE
        data = json.loads(p.read_text())
        data["target_band"] = tuple(data.get("target_band", TARGET_BAND))
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise ValueError(f"{p}: unknown fields {sorted(extra)} (written by a newer ncgrpo?)")
        return cls(**data)


def _lr_at(step: int, lr: float, warmup: int) -> float:
    """The mixed phase's schedule: linear warm-up, then constant. No decay on purpose: the weights
    after step k do not depend on the total step budget, so the state after k steps of a long run IS
    ``pretrain(steps=k)`` (the later phases only follow it), and one run with snapshots (``on_step``)
    measures every mixed budget."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr


def _check_recipe(
    *,
    steps: int,
    vision_warmup_steps: int,
    vision_lr_scale: float,
    pool: Mapping[str, int],
    focus_families: Sequence[str],
    focus_steps: int,
    final_steps: int,
    late_lr: float,
) -> None:
    """The checks :func:`pretrain` and :class:`~ncgrpo.toy.base_model.PretrainConfig` share, before any work: step counts,
    the vision settings, and a focused phase whose families exist and have items in the SFT pool."""

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if vision_warmup_steps < 0:
        raise ValueError(f"vision_warmup_steps must be >= 0, got {vision_warmup_steps}")
    if vision_lr_scale < 0:
        raise ValueError(f"vision_lr_scale must be >= 0 (0 freezes the vision tower), got {vision_lr_scale}")
    for name, value in (("focus_steps", focus_steps), ("final_steps", final_steps)):
        if value < 0:
            raise ValueError(
                f"focus_steps and final_steps must be >= 0 (0 skips that phase), got {name} {value}"
            )
    if late_lr <= 0:
        raise ValueError(f"late_lr must be > 0, got {late_lr}")
    known = {f.name for f in FAMILIES}
    unknown = sorted(set(focus_families) - known)
    if unknown:
        raise ValueError(f"focus_families: unknown {unknown}; families are {sorted(known)}")
    if focus_steps <= 0:
        return
    if not focus_families:
        raise ValueError("focus_steps > 0 needs at least one focus family (or focus_steps 0)")
    missing = [f for f in focus_families if pool.get(f, 0) <= 0]
    if missing:
        raise ValueError(
            f"focus families {missing} have no items in the SFT pool {dict(pool)}; "
            "give them a pool count, or pass other focus families or focus_steps 0"
        )


def _sft_step(model: Any, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One optimiser step on the completion-token loss of ``batch``; returns the loss."""
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())


def _suite_hashes(suite: Mapping[str, Sequence[Question]]) -> set[str]:
    return {q.metadata["hash"] for qs in suite.values() for q in qs}


def pretrain(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    size: str = "tiny",
    pool: Mapping[str, int] | None = None,
    batch_size: int = 16,
    lr: float = 3e-3,
    vision_lr_scale: float = DEFAULT_VISION_LR_SCALE,
    vision_warmup_steps: int = DEFAULT_VISION_WARMUP,
    vision_warmup_lr: float = 1e-3,
    warmup: int = 20,
    weight_decay: float = 0.01,
    focus_families: Sequence[str] = DEFAULT_FOCUS_FAMILIES,
    focus_steps: int = DEFAULT_FOCUS_STEPS,
    final_steps: int = DEFAULT_FINAL_STEPS,
    late_lr: float = DEFAULT_LATE_LR,
    suite_seed: int = 0,
    suite_sizes: Mapping[str, int] | None = None,
    run_eval: bool = True,
    eval_limit: int | None = None,
    group_size: int = 8,
    progress: Callable[[int, float], None] | None = None,
    on_step: Callable[[int, Any, Any], None] | None = None,
    num_threads: int | None = 1,
) -> PretrainReport:
    """Build and supervised-fine-tune the tiny base model; save it (transformers layout) to ``out_dir``.

    Deterministic given the arguments (on one machine and thread count): the tokenizer is trained on
    a fixed corpus, the model is initialised under ``torch.manual_seed(seed)``, batches are drawn by
    ``random.Random(seed)`` and nothing else is random. ``progress(step, loss)`` is called after each
    optimiser step, ``on_step(step, model, processor)`` too (to snapshot or probe; it may switch the
    model to eval mode, training mode is restored after it). With ``run_eval`` the model is evaluated on the suite's validation split
    (``eval_limit`` questions per family at most) by :func:`~ncgrpo.toy.sft_data.evaluate_base`.

    ``num_threads`` (default 1; None leaves torch's setting) is torch's intra-op thread count for the
    call, restored afterwards. One thread is the default because it makes the float reductions, and
    so the weights, independent of the machine's core count, and because on a small shared CPU
    several spinning OpenMP threads ran the SFT loop 7x slower than one (measured on 2 busy cores).
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _pretrain(
            out_dir, seed=seed, steps=steps, size=size, pool=pool, batch_size=batch_size, lr=lr,
            vision_lr_scale=vision_lr_scale, vision_warmup_steps=vision_warmup_steps,
            vision_warmup_lr=vision_warmup_lr, warmup=warmup, weight_decay=weight_decay,
            focus_families=tuple(focus_families), focus_steps=focus_steps, final_steps=final_steps,
            late_lr=late_lr, suite_seed=suite_seed, suite_sizes=suite_sizes,
            run_eval=run_eval, eval_limit=eval_limit, group_size=group_size, progress=progress,
            on_step=on_step,
        )  # fmt: skip
    finally:
        torch.set_num_threads(previous)


def _pretrain(
    out_dir: str | os.PathLike,
    *,
    seed: int,
    steps: int,
    size: str,
    pool: Mapping[str, int] | None,
    batch_size: int,
    lr: float,
    vision_lr_scale: float,
    vision_warmup_steps: int,
    vision_warmup_lr: float,
    warmup: int,
    weight_decay: float,
    focus_families: tuple[str, ...],
    focus_steps: int,
    final_steps: int,
    late_lr: float,
    suite_seed: int,
    suite_sizes: Mapping[str, int] | None,
    run_eval: bool,
    eval_limit: int | None,
    group_size: int,
    progress: Callable[[int, float], None] | None,
    on_step: Callable[[int, Any, Any], None] | None,
) -> PretrainReport:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    pool_counts = dict(DEFAULT_POOL if pool is None else pool)
    _check_recipe(
        steps=steps,
        vision_warmup_steps=vision_warmup_steps,
        vision_lr_scale=vision_lr_scale,
        pool=pool_counts,
        focus_families=focus_families,
        focus_steps=focus_steps,
        final_steps=final_steps,
        late_lr=late_lr,
    )
    t0 = time.perf_counter()
    out = Path(out_dir)
    dims = dict(SIZES[size])
    vocab = dims.pop("vocab_size")

    suite = build_suite(suite_seed, suite_sizes)
    tok = build_tokenizer(corpus(suite), vocab_size=vocab)

    processor = build_processor(tok, image_size=IMAGE_SIZE)
    model = tiny_qwen2_5_vl(processor=processor, seed=seed, **dims)
    suite_hashes = _suite_hashes(suite)  # nothing the model is evaluated on is trained on
    items = sft_pool(seed, pool_counts, exclude=suite_hashes)
    if not items:
        raise ValueError("SFT pool is empty: give at least one family a positive count")
    examples = [encode_example(processor, q) for q in items]

    vision_losses = _vision_warmup(
        model,
        processor,
        steps=vision_warmup_steps,
        lr=vision_warmup_lr,
        batch_size=VISION_BATCH,
        seed=seed,
        exclude=suite_hashes,
    )
    torch.manual_seed(seed)
    rng = random.Random(f"ncgrpo-pretrain-order/{seed}")
    frozen = [p for n, p in model.named_parameters() if "visual" in n] if vision_lr_scale == 0 else []
    for p in frozen:  # no gradient: the SFT loss would overwrite what the warm-up taught the tower
        p.requires_grad_(False)
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for n, p in model.named_parameters():  # (is vision tower/merger, takes weight decay) -> params
        if p.requires_grad:
            groups.setdefault(("visual" in n, p.ndim >= 2 and "embed" not in n), []).append(p)
    opt = torch.optim.AdamW(
        [
            {
                "params": ps,
                "weight_decay": weight_decay if wd else 0.0,
                "lr_scale": vision_lr_scale if vis else 1.0,
            }
            for (vis, wd), ps in sorted(groups.items())
        ],
        lr=lr,
        betas=(0.9, 0.98),
    )
    model.train()
    losses: list[float] = []
    everything = list(range(len(examples)))
    focused = [i for i, q in enumerate(items) if q.metadata["family"] in focus_families]
    schedule = [  # (steps, learning rate at step k of the phase, example indices it draws from)
        (steps, lambda k: _lr_at(k, lr, warmup), everything),
        (focus_steps, lambda k: late_lr, focused),
        (final_steps, lambda k: late_lr, everything),
    ]
    step = 0
    for phase_steps, lr_at, indices in schedule:
        order: list[int] = []
        for k in range(phase_steps):
            if len(order) < batch_size:  # epochs of a fresh shuffle; a batch never spans two epochs' tails
                perm = list(indices)
                rng.shuffle(perm)
                order = perm
            idx, order = order[:batch_size], order[batch_size:]
            for g in opt.param_groups:
                g["lr"] = lr_at(k) * g["lr_scale"]
            losses.append(_sft_step(model, opt, collate([examples[i] for i in idx], tok.pad_token_id)))
            step += 1
            if progress is not None:
                progress(step, losses[-1])
            if on_step is not None:
                on_step(step, model, processor)
                model.train()
    for p in frozen:
        p.requires_grad_(True)
    model.eval()
    train_time = time.perf_counter() - t0

    report = PretrainReport(
        out_dir=str(out),
        seed=seed,
        steps=steps,
        size=size,
        dims={"vocab_size": len(tok), **dims},
        batch_size=batch_size,
        lr=lr,
        vision_lr_scale=vision_lr_scale,
        vision_warmup_steps=vision_warmup_steps,
        vision_losses=[round(x, 5) for x in vision_losses],
        focus_families=list(focus_families),
        focus_steps=focus_steps,
        final_steps=final_steps,
        late_lr=late_lr,
        pool=pool_counts,
        parameters=count_parameters(model),
        losses=[round(x, 5) for x in losses],
        wall_time_s=0.0,
        train_time_s=round(train_time, 2),
        suite_seed=suite_seed,
        num_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        ncgrpo_version=ncgrpo.__version__,
    )
    if run_eval:
        t1 = time.perf_counter()

        val = first_per_family(suite["validation"], eval_limit)
        res = evaluate_base(model, processor, val, group_size=group_size, seed=seed)
        report.eval_time_s = round(time.perf_counter() - t1, 2)
        report.accuracy = {k: round(v, 4) for k, v in res["accuracy"].items()}
        report.sample_accuracy = {k: round(v, 4) for k, v in res["sample_accuracy"].items()}
        report.mixed_share = {k: round(v, 4) for k, v in res["mixed_share"].items()}
        report.group_size = group_size
        report.eval_questions = res["counts"]
        report.eval_correct = res["correct"]
        in_dom = report.accuracy.get("geometry")
        report.in_band = in_dom is not None and TARGET_BAND[0] <= in_dom <= TARGET_BAND[1]
        report.mixed_ok = report.mixed_share.get("geometry", 0.0) >= MIXED_GROUP_TARGET
    save_tiny(model, processor, out)
    name_standard_processor(out)  # AutoProcessor loads it with no ncgrpo import, as the committed base
    report.checkpoint_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    report.wall_time_s = round(time.perf_counter() - t0, 2)

    atomic_write_text(out / PRETRAIN_FILE, json.dumps(report.to_dict(), indent=1, sort_keys=True) + "\n")
    return report
