"""The paper's evaluation protocol: greedy, noise-free decoding, one rule-based scorer, per-question records.

``evaluate`` answers every question of a list, scores each output with :func:`ncgrpo.rewards.score`
(the same function the training reward calls) and appends one :class:`~ncgrpo.eval.records.EvalRecord`
per question to ``OUT/records.jsonl``, flushed and fsync'ed batch by batch. Rerun on the same folder,
it skips the questions already recorded, so a run killed at any point ends, once rerun, with every
question recorded exactly once. No noise hook is ever installed here (section 3.1: "evaluation is
always noise-free").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ncgrpo.data.prompts import build_messages, prompt_hash
from ncgrpo.data.types import MATH_PROMPT, Question
from ncgrpo.eval.records import (
    RECORDS_FILE,
    RUN_FILE,
    EvalRecord,
    RecordWriter,
    atomic_write_json,
    iter_records,
)
from ncgrpo.processors import tokenizer_of
from ncgrpo.rewards import score


@dataclass
class DecodingSettings:
    """Greedy decoding, as the paper evaluates (section 4.1)."""

    max_new_tokens: int = 2048
    batch_size: int = 8
    system_prompt: str | None = None
    math_prompt: str = MATH_PROMPT

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["do_sample"] = False
        d["num_beams"] = 1
        return d


@dataclass
class EvalSummary:
    out_dir: Path
    total: int
    newly_recorded: int
    accuracy: dict[str, float] = field(default_factory=dict)  # benchmark -> accuracy in [0, 1]
    counts: dict[str, int] = field(default_factory=dict)


def _check_run_file(out_dir: Path, run: dict[str, Any]) -> None:
    """A folder holds the records of one model and one decoding setting: refuse to mix."""
    path = out_dir / RUN_FILE
    if not path.exists():
        atomic_write_json(path, run)
        return
    old = json.loads(path.read_text())
    for k in ("model", "checkpoint", "decoding"):
        if old.get(k) != run.get(k):
            raise ValueError(
                f"{path}: this folder holds records of {k}={old.get(k)!r}, not {run.get(k)!r}; "
                "use another --out folder (records of different runs must not mix)"
            )
    merged = {**old, **{k: v for k, v in run.items() if v is not None}}
    if merged != old:
        atomic_write_json(path, merged)


def _render(processor: Any, messages: list[dict[str, Any]]) -> str:
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@torch.no_grad()
def generate_greedy(
    model: Any, processor: Any, questions: Sequence[Question], settings: DecodingSettings
) -> list[str]:
    """Greedy completions for one batch of questions (left-padded, one ``generate`` call)."""
    messages = [
        build_messages(q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt)
        for q in questions
    ]
    texts = [_render(processor, m) for m in messages]
    tok = tokenizer_of(processor)
    has_images = any(q.images for q in questions)
    if has_images:
        if not hasattr(processor, "image_processor"):
            raise ValueError(
                f"{questions[0].uid}: questions have images but the model at hand is text-only "
                "(its processor has no image processor); evaluate a vision-language model"
            )
        images = [[im.convert("RGB") for im in q.images] for q in questions]
        if any(not ims for ims in images):
            raise ValueError("a batch mixes questions with and without images; batch them separately")
        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    else:
        inputs = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    inputs = inputs.to(model.device)
    out = model.generate(
        **inputs,
        do_sample=False,
        num_beams=1,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    completions = out[:, inputs["input_ids"].shape[1] :]
    return tok.batch_decode(completions, skip_special_tokens=True)


def _batches(questions: list[Question], size: int) -> list[list[Question]]:
    # Questions with and without images cannot share a processor call; keep each batch uniform
    # while preserving the input order inside each kind.
    with_img = [q for q in questions if q.images]
    without = [q for q in questions if not q.images]
    out: list[list[Question]] = []
    for group in (with_img, without):
        out.extend(group[i : i + size] for i in range(0, len(group), size))
    return out


def model_id_of(path: str | Path) -> str:
    """A short stable id for a model folder: its name plus a hash of its config and weights index."""
    p = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "generation_config.json"):
        f = p / name
        if f.exists():
            h.update(f.read_bytes())
    weights = sorted(p.glob("*.safetensors"))
    for w in weights:
        h.update(w.name.encode())
        h.update(str(w.stat().st_size).encode())
    return f"{p.name}@{h.hexdigest()[:12]}" if p.exists() else str(path)


def evaluate(
    model: Any,
    processor: Any,
    questions: Sequence[Question],
    out_dir: str | Path,
    *,
    model_id: str,
    checkpoint: str | None = None,
    seed: int | None = None,
    name: str | None = None,
    method: str | None = None,
    settings: DecodingSettings | None = None,
    progress: bool = True,
) -> EvalSummary:
    """Answer ``questions`` greedily and append one record per new question to ``out_dir``.

    Already-recorded questions (same benchmark and question id) are skipped, so rerunning after a
    crash completes the folder without duplicates.
    """
    settings = settings or DecodingSettings()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    decoding = settings.to_dict()
    _check_run_file(
        out,
        {
            "name": name or model_id,
            "method": method,
            "seed": seed,
            "model": model_id,
            "checkpoint": checkpoint,
            "decoding": decoding,
        },
    )
    uids = [(q.benchmark, q.question_id) for q in questions]
    if len(set(uids)) != len(uids):
        dup = next(u for u in uids if uids.count(u) > 1)
        raise ValueError(f"question {dup[0]}/{dup[1]} appears twice in the evaluation set")
    records_path = out / RECORDS_FILE
    done = {r.key for r in iter_records(records_path)} if records_path.exists() else set()
    todo = [q for q in questions if (q.benchmark, q.question_id) not in done]

    from tqdm.auto import tqdm

    was_training = model.training
    model.eval()
    new = 0
    try:
        with (
            RecordWriter(records_path) as writer,
            tqdm(
                total=len(questions),
                initial=len(questions) - len(todo),
                desc=f"eval {out.name}",
                unit="q",
                disable=not progress,
            ) as bar,
        ):
            for batch in _batches(todo, settings.batch_size):
                outputs = generate_greedy(model, processor, batch, settings)
                recs = []
                for q, text in zip(batch, outputs, strict=True):
                    s = score(text, q.answer, choices=q.choices, answer_type=q.answer_type)
                    msgs = build_messages(
                        q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt
                    )
                    recs.append(
                        EvalRecord(
                            benchmark=q.benchmark,
                            question_id=q.question_id,
                            role=q.role,
                            prompt_hash=prompt_hash(msgs),
                            output=text,
                            extracted=s.extracted,
                            gold=q.answer,
                            correct=bool(s.correct),
                            model=model_id,
                            checkpoint=checkpoint,
                            seed=seed,
                            decoding=decoding,
                        )
                    )
                writer.write(recs)
                new += len(recs)
                bar.update(len(recs))
    finally:
        model.train(was_training)

    wanted = set(uids)
    acc: dict[str, list[int]] = {}
    for r in iter_records(records_path):
        if r.key in wanted:
            acc.setdefault(r.benchmark, []).append(int(r.correct))
    return EvalSummary(
        out_dir=out,
        total=len(questions),
        newly_recorded=new,
        accuracy={b: sum(v) / len(v) for b, v in sorted(acc.items())},
        counts={b: len(v) for b, v in sorted(acc.items())},
    )
