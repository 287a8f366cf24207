"""The embedded base model: a tiny Qwen2.5-VL supervised-fine-tuned on the synthetic suite's traces.

The paper starts RL from Qwen2.5-VL-7B-Instruct, a model that already has general visual skills and
solves part of Geometry3K, and trains only on Geometry3K (section 4.1). The offline miniature needs a
base model in the same position, so ``ncgrpo demo`` and the tests can run the real Qwen2.5-VL code
paths (hidden-state hooks, the TRL trainer, the eval runner) from a fresh clone on a CPU:

* the architecture is ``Qwen2_5_VLForConditionalGeneration`` at toy scale (:data:`SIZES`), with a
  byte-level BPE tokenizer trained on :func:`ncgrpo.toy.synthetic.corpus` of the suite and the
  Qwen2.5-VL processor at the suite's 84 px image size (6 x 6 patches of 14 px, 9 merged image tokens);
* its vision tower and merger are first pre-trained for :data:`DEFAULT_VISION_WARMUP` steps on scene
  attributes of fresh images of every family (:func:`scene_targets`: a figure's corner count and
  written labels, which coloured shapes a scene holds and how many, which of two objects is bigger,
  each bar's height and colour; heads on the merged image tokens, discarded afterwards,
  :func:`_vision_warmup`). Without this the SFT run learns the traces' text prior long before the
  random tower carries signal and the language model learns to ignore the image (measured: 14%
  greedy in-domain, "6 sides" for every figure, training loss unchanged when the images are
  shuffled). The tower is then frozen (:data:`DEFAULT_VISION_LR_SCALE` = 0): SFT through a trainable
  tower erased the colour-to-shape binding the warm-up had taught (a linear probe read the asked
  shape's colour 71% right after the warm-up, 22% after SFT);
* it is then supervised-fine-tuned on ``prompt -> warmup_trace(q)`` pairs, the prompt being exactly
  what training and evaluation feed the model (:func:`ncgrpo.data.prompts.build_messages` rendered by
  the processor's chat template with ``add_generation_prompt=True``), the loss on the completion
  tokens only (the trace and the closing ``<|im_end|>``);
* the SFT pool (:func:`sft_pool`) holds items of EVERY family (the base model's "general skills"),
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
  instead (:func:`ncgrpo.toy.synthetic.shortcut_trace`: ``answer: 4.`` for every "how many sides"
  question). The base's greedy answer is that shortcut, right only when the figure happens to fit,
  while it also samples derivations that read the figure: greedy accuracy inside
  :data:`TARGET_BAND`, enough groups with mixed rewards (section 3: a group whose rewards are all
  equal has zero advantage, eq. 1), and a lesson GRPO can learn in a few dozen steps (prefer the
  derivation), decided at the first reasoning token, where the prefill noise acts.

The band is checked and reported (``PretrainReport.in_band``), never forced; the committed
checkpoint's ``pretrain.json`` records where the default recipe lands. The mixed phase's learning
rate is constant after warm-up, so its first k steps are exactly ``pretrain(steps=k)`` and one run
with snapshots (``on_step``) measures every mixed budget up to its length.
:func:`ensure_base_model` returns the checkpoint committed as package data under
``src/ncgrpo/toy/assets/base`` when present, else builds one into a per-version cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ncgrpo.data.types import Question

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
    "PretrainConfig",
    "PretrainReport",
    "encode_example",
    "ensure_base_model",
    "evaluate_base",
    "pretrain",
    "run_pretrain",
    "sft_pool",
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
#: during SFT; 0 freezes them at what the vision warm-up taught (see :func:`_vision_warmup`).
DEFAULT_VISION_LR_SCALE = 0.0
#: Steps of vision-tower pre-training on scene attributes before SFT (see :func:`_vision_warmup`).
DEFAULT_VISION_WARMUP = 4000
#: Fresh scenes per vision warm-up step.
VISION_BATCH = 48


# ------------------------------------------------------------------------------------------ data


def sft_pool(
    seed: int, counts: Mapping[str, int], exclude: set[str] | frozenset[str] = frozenset()
) -> list[Question]:
    """Items for supervised warm-up, ``counts[family]`` per family, none whose content hash is in
    ``exclude`` (pass every hash of the suite the model will be evaluated on).

    Each family draws from its own stream ``ncgrpo-pretrain/{seed}/{family}``, distinct from the
    suite's ``ncgrpo-synthetic/...`` streams, so the pool does not change when the suite's sizes do.
    """
    from ncgrpo.toy.synthetic import FAMILIES, content_hash, family, make_question

    known = {f.name for f in FAMILIES}
    unknown = set(counts) - known
    if unknown:
        raise ValueError(f"SFT pool: unknown families {sorted(unknown)}; families are {sorted(known)}")
    seen = set(exclude)
    pool: list[Question] = []
    for name, n in counts.items():
        if n < 0:
            raise ValueError(f"SFT pool: count for {name!r} must be >= 0, got {n}")
        fam = family(name)
        rng = random.Random(f"ncgrpo-pretrain/{seed}/{name}")
        count = tries = 0
        while count < n:
            tries += 1
            if tries > 20 * n + 100:
                raise RuntimeError(
                    f"SFT pool: family {name!r} ran out of distinct items after {count} of {n}; ask for fewer"
                )
            item = fam.sample(rng)
            key = content_hash(name, item.problem, item.spec)
            if key in seen:
                continue
            seen.add(key)
            pool.append(make_question(fam, item, key, split="pretrain", index=count, seed=seed))
            count += 1
    return pool


@dataclass
class Example:
    """One tokenised SFT pair. ``input_ids`` = prompt ids (image pads expanded) + completion ids."""

    input_ids: torch.Tensor  # (L,) long
    mm_token_type_ids: torch.Tensor  # (L,) long: 1 on image pads, 0 on text (M-RoPE needs it)
    prompt_len: int
    pixel_values: torch.Tensor  # (patches, C * T * P * P) float
    image_grid_thw: torch.Tensor  # (images, 3) long
    family: str


def encode_example(processor: Any, q: Question, completion: str | None = None) -> Example:
    """Tokenise ``q`` for SFT. The prompt is rendered exactly as generation renders it (same messages,
    same chat template, ``add_generation_prompt=True``) and tokenised by the processor with the image;
    the completion (default: the warm-up's, :func:`ncgrpo.toy.synthetic.warmup_trace`) ``+ <|im_end|>``
    is tokenised on its own and appended, so the prompt/completion boundary is the one the model sees
    when it generates.

    ``mm_token_type_ids`` must reach the forward pass: without it Qwen2.5-VL cannot build its 3-D
    M-RoPE positions and falls back to plain 1-D positions, while ``generate`` (given the processor's
    output) uses M-RoPE. A model trained without it learns positions that generation never shows it
    (measured: teacher-forced loss fine, greedy outputs that ignore the question)."""
    from ncgrpo.data.prompts import build_messages
    from ncgrpo.toy.model import EOS_TOKEN
    from ncgrpo.toy.synthetic import warmup_trace

    tok = processor.tokenizer
    text = processor.apply_chat_template(build_messages(q), add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=[[im.convert("RGB") for im in q.images]], return_tensors="pt")
    text_out = warmup_trace(q) if completion is None else completion
    completion_enc = tok(text_out + EOS_TOKEN, add_special_tokens=False, return_tensors="pt")
    prompt_ids = enc["input_ids"][0]
    n_completion = int(completion_enc["input_ids"].shape[1])
    return Example(
        input_ids=torch.cat([prompt_ids, completion_enc["input_ids"][0]]),
        mm_token_type_ids=torch.cat(
            [enc["mm_token_type_ids"][0].long(), torch.zeros(n_completion, dtype=torch.long)]
        ),
        prompt_len=int(prompt_ids.shape[0]),
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        family=q.metadata.get("family", q.benchmark),
    )


def collate(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; labels are -100 on prompt and padding positions (loss on completions only)."""
    width = max(int(e.input_ids.shape[0]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(examples), width), dtype=torch.long)  # (B, L)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # (B, L)
    types = torch.zeros((len(examples), width), dtype=torch.long)  # (B, L)
    for i, e in enumerate(examples):
        n = int(e.input_ids.shape[0])
        ids[i, :n] = e.input_ids
        mask[i, :n] = 1
        types[i, :n] = e.mm_token_type_ids
        labels[i, e.prompt_len : n] = e.input_ids[e.prompt_len :]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": types,
        "pixel_values": torch.cat([e.pixel_values for e in examples]),  # (sum patches, D)
        "image_grid_thw": torch.cat([e.image_grid_thw for e in examples]),  # (B, 3)
    }


# ------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def evaluate_base(
    model: Any,
    processor: Any,
    questions: Sequence[Question],
    *,
    group_size: int = 8,
    mixed_families: Sequence[str] = ("geometry",),
    batch_size: int = 16,
    max_new_tokens: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy accuracy per family, plus, for ``mixed_families``, the share of prompts whose
    ``group_size`` completions sampled at temperature 1 (top-k/top-p off, as TRL's GRPO defaults)
    are neither all correct nor all wrong: exactly the groups with a non-zero GRPO advantage (eq. 1).

    Returns ``{"accuracy": {family: acc}, "correct": {uid: bool}, "mixed_share": {family: share},
    "sample_accuracy": {family: acc}, "counts": {family: n}}``. Scoring is :func:`ncgrpo.rewards.score`,
    the same function training rewards and ``ncgrpo eval`` use.
    """
    from ncgrpo.eval.evaluate import DecodingSettings, score_greedy
    from ncgrpo.rewards import score

    was_training = model.training
    model.eval()
    settings = DecodingSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
    by_family: dict[str, list[Question]] = {}
    for q in questions:
        by_family.setdefault(q.metadata.get("family", q.benchmark), []).append(q)
    correct: dict[str, bool] = {}
    acc: dict[str, float] = {}
    for fam, qs in by_family.items():
        hits = []
        for i in range(0, len(qs), batch_size):
            batch = qs[i : i + batch_size]
            for q, (_, s) in zip(batch, score_greedy(model, processor, batch, settings), strict=True):
                ok = bool(s.correct)
                correct[q.uid] = ok
                hits.append(ok)
        acc[fam] = sum(hits) / len(hits)

    mixed: dict[str, float] = {}
    sample_acc: dict[str, float] = {}
    tok = processor.tokenizer
    per_call = max(1, batch_size // group_size) * 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for fam in mixed_families:
            qs = by_family.get(fam, [])
            n_mixed, n_right, n_all = 0, 0, 0
            for i in range(0, len(qs), per_call):
                batch = qs[i : i + per_call]
                texts = [_prompt_text(processor, q) for q in batch]
                images = [[im.convert("RGB") for im in q.images] for q in batch]
                inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(
                    model.device
                )
                out = model.generate(
                    **inputs,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    num_return_sequences=group_size,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tok.pad_token_id,
                )  # (len(batch) * G, prompt + new), rows of one prompt adjacent
                texts_out = tok.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                for j, q in enumerate(batch):
                    group = texts_out[j * group_size : (j + 1) * group_size]
                    rewards = [
                        bool(score(t, q.answer, choices=q.choices, answer_type=q.answer_type).correct)
                        for t in group
                    ]
                    n_mixed += 0 < sum(rewards) < group_size
                    n_right += sum(rewards)
                    n_all += group_size
            if qs:
                mixed[fam] = n_mixed / len(qs)
                sample_acc[fam] = n_right / n_all
    model.train(was_training)
    return {
        "accuracy": acc,
        "counts": {f: len(v) for f, v in by_family.items()},
        "mixed_share": mixed,
        "sample_accuracy": sample_acc,
        "group_size": group_size,
        "correct": correct,
    }


def _prompt_text(processor: Any, q: Question) -> str:
    from ncgrpo.data.prompts import build_messages

    return processor.apply_chat_template(build_messages(q), add_generation_prompt=True, tokenize=False)


# ------------------------------------------------------------------------------- vision warm-up


#: Figure label texts the vision warm-up predicts: side lengths 2-6 and angles 20-90 (the suite's ranges).
LABEL_VALUES = tuple(str(v) for v in range(2, 7)) + tuple(str(v) for v in range(20, 91, 10))
#: Family mix of the vision warm-up's batches (scenes are drawn in this cyclic order).
VISION_MIX = ("geometry", "geometry", "counting", "bar_chart", "compare", "colour_choice", "pope")
_MAX_COUNT = 12  # objects of one shape in a scene: counting draws at most 9 targets + 3 distractors


def _target_layout() -> dict[str, tuple[int, int]]:
    """Slices ``name -> (start, stop)`` of the vision warm-up's target vector."""
    from ncgrpo.toy.synthetic import BAR_MAX, COLOURS, SHAPES

    sizes = {
        "corners": 4,  # figure: vertices 3..6, one-hot
        "labels": len(LABEL_VALUES),  # figure: which label texts are written
        "objects": len(COLOURS) * len(SHAPES),  # objects: which (colour, shape) pairs are present
        "counts": len(SHAPES) * (_MAX_COUNT + 1),  # objects: per shape, how many (one-hot)
        "left_bigger": 1,  # two-object comparison scenes: is the left object the bigger one
        "bar_heights": 4 * BAR_MAX,  # bars, left to right: height 1..BAR_MAX (one-hot)
        "bar_colours": 4 * len(COLOURS),  # bars, left to right: colour (one-hot)
    }
    layout, at = {}, 0
    for name, n in sizes.items():
        layout[name] = (at, at + n)
        at += n
    return layout


def scene_targets(spec: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the vision warm-up predicts from an image: ``(targets (D,), mask (D,))`` read off the
    scene spec of any family (:func:`_target_layout` names the slices; the mask is 1 on the slices
    that apply to the scene's type).

    These are the facts the warm-up traces read from the image: the corner count and written labels
    of a figure (in-domain), which coloured shapes a scene holds and how many of each (counting,
    colour, POPE), which of two objects is bigger (compare), and each bar's height and colour (bar
    charts). With geometry targets only, the base answered every compare, colour and POPE question
    with one constant ("left", "blue", "yes"); with these targets and the tower frozen during SFT it
    reads compare questions (92% of the first 300 test questions) and counting and bar charts well
    above their best constant answer. Colour and POPE stay constant after mixed SFT alone (the
    language model, not the tower, is the limit there: a linear probe on the frozen tokens reads the
    asked shape's colour 60% of the time); the curriculum that ends SFT teaches the language model
    that read (:func:`pretrain`)."""
    from ncgrpo.toy.synthetic import BAR_MAX, COLOURS, SHAPES

    layout = _target_layout()
    dim = max(stop for _, stop in layout.values())
    t, m = torch.zeros(dim), torch.zeros(dim)

    def on(name: str) -> int:
        start, stop = layout[name]
        m[start:stop] = 1.0
        return start

    colours, shapes = list(COLOURS), list(SHAPES)
    scene = spec["scene"]
    if scene["type"] == "figure":
        t[on("corners") + len(scene["vertices"]) - 3] = 1.0
        at = on("labels")
        for lab in scene["labels"]:
            t[at + LABEL_VALUES.index(lab["text"])] = 1.0
    elif scene["type"] == "objects":
        obs = scene["objects"]
        at = on("objects")
        for ob in obs:
            t[at + colours.index(ob["colour"]) * len(shapes) + shapes.index(ob["shape"])] = 1.0
        at = on("counts")
        for k, shape in enumerate(shapes):
            t[at + k * (_MAX_COUNT + 1) + sum(ob["shape"] == shape for ob in obs)] = 1.0
        if spec.get("ask", {}).get("kind") == "compare":
            left, right = sorted(obs, key=lambda ob: ob["x"])
            t[on("left_bigger")] = float(left["r"] > right["r"])
    elif scene["type"] == "bars":
        bars = sorted(scene["bars"], key=lambda b: b["x0"])
        at_h, at_c = on("bar_heights"), on("bar_colours")
        for k, bar in enumerate(bars):
            t[at_h + k * BAR_MAX + bar["height"] - 1] = 1.0
            t[at_c + k * len(colours) + colours.index(bar["colour"])] = 1.0
    else:
        raise ValueError(f"no vision targets for scene type {scene['type']!r}")
    return t, m


def _scene_stream(seed: int, name: str, exclude: set[str] | frozenset[str]) -> Iterator[Any]:
    """Fresh items of one family for the vision warm-up, none whose content hash is in ``exclude``."""
    from ncgrpo.toy.synthetic import content_hash, family

    fam = family(name)
    rng = random.Random(f"ncgrpo-pretrain-vision/{seed}/{name}")
    while True:
        item = fam.make(rng)
        if content_hash(name, item.problem, item.spec) not in exclude:
            yield item


def _vision_warmup(
    model: Any,
    processor: Any,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    exclude: set[str] | frozenset[str] = frozenset(),
    mix: Sequence[str] = VISION_MIX,
) -> list[float]:
    """Pre-train the vision tower and merger on scene attributes before SFT; returns the losses.

    Why: trained end to end from scratch, the language model learns the text prior of the traces
    in a few dozen steps, long before the random vision tower carries any signal, and then learns
    to ignore the image tokens (measured on a 600-step checkpoint: its training loss is the same
    with the batch's images shuffled or zeroed). A linear head on the 9 merged image tokens (the
    exact vectors the LM reads, concatenated) predicts :func:`scene_targets` (masked binary
    cross-entropy); the head is then discarded, only the tower's weights carry over.

    Every step draws ``batch_size`` fresh scenes (families in ``mix``'s cyclic order, each from its
    own seeded stream, none in ``exclude``): binding a colour to a shape needs many images. Trained
    on a fixed pool of 3,000 object scenes the tower memorised them (held-out exact set of
    (colour, shape) pairs 20% after 3,000 steps); on 16,000 it reached 79%, still rising.
    Deterministic: the head is initialised and the scenes drawn from ``seed``.
    """
    if steps <= 0:
        return []
    visual = model.model.visual
    image_processor = processor.image_processor
    streams = {name: _scene_stream(seed, name, exclude) for name in dict.fromkeys(mix)}

    def batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        names = [mix[(step * batch_size + j) % len(mix)] for j in range(batch_size)]
        items = [next(streams[name]) for name in names]
        enc = image_processor(images=[it.image for it in items], return_tensors="pt")
        targets, masks = zip(*(scene_targets(it.spec) for it in items), strict=True)
        return enc, torch.stack(targets), torch.stack(masks)

    enc0, t0, _ = batch(0)
    with torch.no_grad():
        merged = _merged(visual(enc0["pixel_values"], grid_thw=enc0["image_grid_thw"]))  # (B * tokens, H)
        width = merged.numel() // len(t0)  # merged tokens * out_hidden of one image
    hidden = merged.shape[-1]
    tokens = width // hidden
    obj_start, obj_stop = _target_layout()["objects"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(width, t0.shape[1])
        token_head = torch.nn.Linear(hidden, obj_stop - obj_start)
    params = list(visual.parameters()) + list(head.parameters()) + list(token_head.parameters())

    def predict(feats: torch.Tensor) -> torch.Tensor:
        """Logits (B, D): a linear head on the concatenated tokens, except the (colour, shape)
        presences, which are a soft OR over tokens of one shared per-token head (logsumexp): "some
        token holds a red square". That makes each image token say what it holds, the same way at
        every position -- what a language model reading the tokens through attention can use."""
        logits = head(feats.reshape(-1, width))  # (B, D)
        per_token = token_head(feats.reshape(-1, tokens, hidden))  # (B, tokens, pairs)
        return torch.cat(
            [logits[:, :obj_start], torch.logsumexp(per_token, dim=1), logits[:, obj_stop:]], dim=1
        )

    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    visual.train()
    for step in range(steps):
        enc, targets, masks = batch(step)
        feats = _merged(visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]))
        logits = predict(feats)  # (B, D)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        loss = (bce * masks).sum() / masks.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _merged(out: Any) -> torch.Tensor:
    """The merged image tokens (tokens, out_hidden) of a vision-tower output."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


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
    """The checks :func:`pretrain` and :class:`PretrainConfig` share, before any work: step counts,
    the vision settings, and a focused phase whose families exist and have items in the SFT pool."""
    from ncgrpo.toy.synthetic import FAMILIES

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
    (``eval_limit`` questions per family at most) by :func:`evaluate_base`.

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
    import transformers

    import ncgrpo
    from ncgrpo.processors import name_standard_processor
    from ncgrpo.toy.model import (
        build_processor,
        build_tokenizer,
        count_parameters,
        save_tiny,
        tiny_qwen2_5_vl,
    )
    from ncgrpo.toy.synthetic import build_suite, corpus

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
    from ncgrpo.toy.synthetic import IMAGE_SIZE

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
        from ncgrpo.toy.synthetic import first_per_family

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
    from ncgrpo.runs.folder import atomic_write_text

    atomic_write_text(out / PRETRAIN_FILE, json.dumps(report.to_dict(), indent=1, sort_keys=True) + "\n")
    return report


# --------------------------------------------------------------------------------- base model


def _recipe_hash() -> str:
    """Identity of what :func:`pretrain` builds by default: version, sizes, pool, steps and the
    warm-up traces' mix (shortcut share and answers), so a cached base built from other traces is
    not reused."""
    import ncgrpo
    from ncgrpo.toy.synthetic import DIRECT_SHARE, SHORTCUT_ANSWERS

    blob = json.dumps(
        {
            "v": ncgrpo.__version__,
            "sizes": SIZES["tiny"],
            "pool": DEFAULT_POOL,
            "steps": DEFAULT_STEPS,
            "focus": [DEFAULT_FOCUS_FAMILIES, DEFAULT_FOCUS_STEPS, DEFAULT_FINAL_STEPS, DEFAULT_LATE_LR],
            "vision_warmup": DEFAULT_VISION_WARMUP,
            "vision_lr_scale": DEFAULT_VISION_LR_SCALE,
            "vision_batch": VISION_BATCH,
            "vision_mix": VISION_MIX,
            "direct_share": DIRECT_SHARE,
            "shortcut": SHORTCUT_ANSWERS,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _is_complete(path: Path) -> bool:
    return (
        (path / PRETRAIN_FILE).is_file()
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_base_model(cache_dir: str | os.PathLike | None = None, *, use_asset: bool = True) -> Path:
    """The folder of the embedded base model, ready for ``load_model_and_processor``.

    The checkpoint committed under ``src/ncgrpo/toy/assets/base`` (:data:`ASSET_DIR`) when it is there
    (and ``use_asset``);
    otherwise ``cache_dir`` (default ``~/.cache/ncgrpo``) ``/base-<recipe hash>``, built by
    :func:`pretrain` with the default recipe on first use. Concurrent callers serialise on a lock
    file, and the build goes to a temporary folder renamed into place, so no caller ever sees a
    half-written checkpoint.
    """
    if use_asset and _is_complete(ASSET_DIR):
        return ASSET_DIR
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "ncgrpo"
    target = root / f"base-{_recipe_hash()}"
    if _is_complete(target):
        return target
    with _file_lock(root / f".base-{_recipe_hash()}.lock"):
        if _is_complete(target):  # built by another caller while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".base-build-", dir=root))
        try:
            pretrain(tmp)
            if target.exists():  # a stale, incomplete folder from an interrupted older build
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


# ------------------------------------------------------------------------------------ command line
@dataclass
class PretrainConfig:
    """What ``ncgrpo pretrain`` runs: :func:`pretrain`'s settings, one flag (and config key) each."""

    output_dir: Path = field(
        metadata={"help": "output folder (model, processor, pretrain.json); must be new or empty (was --out)"}
    )
    seed: int = field(default=0, metadata={"help": "initialisation / data-order / SFT-pool seed"})
    max_steps: int = field(
        default=DEFAULT_STEPS, metadata={"help": "optimiser steps of the mixed phase (was --steps)"}
    )
    size: str = field(
        default="tiny",
        metadata={
            "help": "model size: tiny (the embedded base model) or micro (tests)",
            "choices": list(SIZES),
        },
    )
    pool: list[str] = field(
        default_factory=list,
        metadata={
            "help": "SFT pool items per family as FAMILY=N, e.g. --pool geometry=1200 pope=300 "
            "(none: ncgrpo.toy.pretrain.DEFAULT_POOL)"
        },
    )
    batch_size: int = field(default=16, metadata={"help": "examples per optimiser step"})
    vision_warmup_steps: int = field(
        default=DEFAULT_VISION_WARMUP,
        metadata={"help": "steps of vision-tower pre-training on scene attributes before SFT; 0 skips it"},
    )
    vision_lr_scale: float = field(
        default=DEFAULT_VISION_LR_SCALE,
        metadata={"help": "SFT learning-rate multiplier of the vision tower and merger; 0 freezes them"},
    )
    lr: float | None = field(default=None, metadata={"help": "peak learning rate (null: pretrain's default)"})
    focus_families: list[str] = field(
        default_factory=lambda: list(DEFAULT_FOCUS_FAMILIES),
        metadata={"help": "families the focused phase after the mixed steps trains on alone"},
    )
    focus_steps: int = field(
        default=DEFAULT_FOCUS_STEPS,
        metadata={"help": "steps on the focus families' pool items after the mixed steps; 0 skips the phase"},
    )
    final_steps: int = field(
        default=DEFAULT_FINAL_STEPS,
        metadata={"help": "mixed steps after the focused phase; 0 ends after it"},
    )
    late_lr: float = field(
        default=DEFAULT_LATE_LR, metadata={"help": "learning rate of the focused and final phases"}
    )
    suite_seed: int = field(default=0, metadata={"help": "seed of the synthetic suite evaluated on"})
    eval: bool = field(
        default=True, metadata={"help": "evaluate on the validation split after training (--no_eval: skip)"}
    )
    eval_limit: int | None = field(
        default=None, metadata={"help": "at most N validation questions per family (null: all)"}
    )
    group_size: int = field(default=8, metadata={"help": "G for the share of groups with mixed rewards"})
    num_threads: int = field(
        default=1,
        metadata={
            "help": "torch intra-op threads (1: reproducible, fast on busy CPUs)",
        },
    )
    progress: bool = field(default=True, metadata={"help": "progress bar (--no_progress: none)"})

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.size not in SIZES:
            raise ValueError(f"size {self.size!r} is unknown; choose one of {', '.join(sorted(SIZES))}")
        for name in ("batch_size", "group_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise ValueError(f"eval_limit must be >= 1 or null, got {self.eval_limit}")
        _check_recipe(
            steps=self.max_steps,
            vision_warmup_steps=self.vision_warmup_steps,
            vision_lr_scale=self.vision_lr_scale,
            pool=self.pool_counts() or DEFAULT_POOL,  # raises on a malformed --pool entry
            focus_families=self.focus_families,
            focus_steps=self.focus_steps,
            final_steps=self.final_steps,
            late_lr=self.late_lr,
        )

    def pool_counts(self) -> dict[str, int] | None:
        """``["geometry=1200", "pope=300"]`` -> ``{"geometry": 1200, "pope": 300}``; None: the default pool."""
        if not self.pool:
            return None
        counts: dict[str, int] = {}
        for item in self.pool:
            name, sep, value = str(item).partition("=")
            if not sep or not name.strip():
                raise ValueError(f"pool: expected FAMILY=N, got {item!r}")
            try:
                counts[name.strip()] = int(value)
            except ValueError:
                raise ValueError(
                    f"pool: count for {name.strip()!r} must be an integer, got {value!r}"
                ) from None
        return counts


def run_pretrain(cfg: PretrainConfig, progress: Callable[[int, float], None] | None = None) -> PretrainReport:
    """:func:`pretrain` with ``cfg``'s settings, into a new or empty ``cfg.output_dir``, holding its lock
    (:class:`ncgrpo.runs.folder.FolderLock`, kind ``pretrain``: a second pretrain into it fails at once,
    naming the first). Only the lock file and a ``run.json`` of an interrupted pretrain may be there."""
    from ncgrpo.runs.folder import LOCK_FILE, RUN_FILE, FolderLock, atomic_write_json

    lock = FolderLock(cfg.output_dir, "ncgrpo pretrain", kind="pretrain")
    lock.check()
    ours = {LOCK_FILE, RUN_FILE}
    if cfg.output_dir.is_dir() and any(p.name not in ours for p in cfg.output_dir.iterdir()):
        raise ValueError(f"{cfg.output_dir} exists and is not empty; pass a new --output_dir folder")
    with lock:
        atomic_write_json(cfg.output_dir / RUN_FILE, {"kind": "pretrain", "finished": False})
        report = _run_pretrain(cfg, progress)
        atomic_write_json(cfg.output_dir / RUN_FILE, {"kind": "pretrain", "finished": True})
    return report


def _run_pretrain(cfg: PretrainConfig, progress: Callable[[int, float], None] | None) -> PretrainReport:
    extra: dict[str, Any] = {} if cfg.lr is None else {"lr": cfg.lr}
    pool = cfg.pool_counts()
    if pool is not None:
        extra["pool"] = pool
    return pretrain(
        cfg.output_dir,
        seed=cfg.seed,
        steps=cfg.max_steps,
        size=cfg.size,
        batch_size=cfg.batch_size,
        vision_warmup_steps=cfg.vision_warmup_steps,
        vision_lr_scale=cfg.vision_lr_scale,
        focus_families=tuple(cfg.focus_families),
        focus_steps=cfg.focus_steps,
        final_steps=cfg.final_steps,
        late_lr=cfg.late_lr,
        suite_seed=cfg.suite_seed,
        run_eval=cfg.eval,
        eval_limit=cfg.eval_limit,
        group_size=cfg.group_size,
        num_threads=cfg.num_threads,
        progress=progress,
        **extra,
    )
