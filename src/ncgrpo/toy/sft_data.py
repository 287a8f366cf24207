"""The embedded base model's supervised warm-up data (:mod:`ncgrpo.toy.pretrain`): the item pool,
each item tokenised as generation sees it, the batches, and the base's evaluation (greedy accuracy and
the share of GRPO groups with mixed rewards)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ncgrpo.data.prompts import render_prompt
from ncgrpo.data.types import Question
from ncgrpo.eval.evaluate import DecodingSettings, score_greedy
from ncgrpo.rewards import score
from ncgrpo.toy.model import EOS_TOKEN
from ncgrpo.toy.suite import content_hash, make_question
from ncgrpo.toy.synthetic import FAMILIES, family
from ncgrpo.toy.traces import warmup_trace

__all__ = ["Example", "collate", "encode_example", "evaluate_base", "sft_pool"]


# ------------------------------------------------------------------------------------------ data


def sft_pool(
    seed: int, counts: Mapping[str, int], exclude: set[str] | frozenset[str] = frozenset()
) -> list[Question]:
    """Items for supervised warm-up, ``counts[family]`` per family, none whose content hash is in
    ``exclude`` (pass every hash of the suite the model will be evaluated on).

    Each family draws from its own stream ``ncgrpo-pretrain/{seed}/{family}``, distinct from the
    suite's ``ncgrpo-synthetic/...`` streams, so the pool does not change when the suite's sizes do.
    """

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
    the completion (default: the warm-up's, :func:`ncgrpo.toy.traces.warmup_trace`) ``+ <|im_end|>``
    is tokenised on its own and appended, so the prompt/completion boundary is the one the model sees
    when it generates.

    ``mm_token_type_ids`` must reach the forward pass: without it Qwen2.5-VL cannot build its 3-D
    M-RoPE positions and falls back to plain 1-D positions, while ``generate`` (given the processor's
    output) uses M-RoPE. A model trained without it learns positions that generation never shows it
    (measured: teacher-forced loss fine, greedy outputs that ignore the question)."""

    tok = processor.tokenizer
    text = render_prompt(processor, q)
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
                texts = [render_prompt(processor, q) for q in batch]
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
