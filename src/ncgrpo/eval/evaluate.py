"""The paper's evaluation protocol: greedy, noise-free decoding, one rule-based scorer, per-question records.

``evaluate`` answers every question of a list, scores each output with :func:`ncgrpo.rewards.score`
(the same function the training reward calls) and appends one :class:`~ncgrpo.eval.records.EvalRecord`
per question to ``OUT/records.jsonl``, flushed and fsync'ed batch by batch. Rerun on the same folder,
it skips the questions already recorded, so a run killed at any point ends, once rerun, with every
question recorded exactly once. No noise hook is ever installed here (section 3.1: "evaluation is
always noise-free").

Two engines decode: ``transformers`` (``model.generate``, one call per batch of ``batch_size``
questions) and ``vllm`` (:mod:`ncgrpo.eval.vllm_engine`: every pending question submitted to vLLM's
offline engine at once, each record appended as its question finishes). The engine is part of a
folder's identity (run.json ``engine``; a folder written before the field existed is
``transformers``), so records of the two never mix in one folder.

The parts: greedy decoding (:mod:`ncgrpo.eval.decoding`), loading the model for an engine
(:mod:`ncgrpo.eval.model_load`), the model id (:mod:`ncgrpo.eval.model_id`); this module holds a folder's
identity and the checks on it, and :func:`evaluate`, and re-exports the parts' names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncgrpo.data.prompts import build_messages, image_hash, prompt_hash
from ncgrpo.data.types import Question
from ncgrpo.eval.decoding import (
    ENGINES,
    DecodingSettings,
    engine_of,
    eval_mode,
    generate_greedy,
    question_batches,
    score_greedy,
)
from ncgrpo.eval.model_id import (
    LOAD_OPTIONS,
    MODEL_ID_FILES,
    MODEL_ID_RULE,
    NOT_WEIGHTS,
    file_sha256,
    model_id_of,
    weight_files,
)
from ncgrpo.eval.model_load import (
    ADAPTER_CONFIG,
    adapter_base,
    check_adapter_base,
    check_finite_weights,
    check_images,
    config_reads_images,
    load_adapter,
    load_for_eval,
    takes_images,
)
from ncgrpo.eval.records import LEGACY_DECODING, EvalRecord, RecordWriter, iter_records, record_producer
from ncgrpo.rewards import score
from ncgrpo.runs.folder import (
    RECORDS_FILE,
    RUN_FILE,
    FolderLock,
    atomic_write_json,
    check_folder_kind,
    read_run_json,
    repair_torn_tail,
)
from ncgrpo.runs.provenance import continue_provenance, provenance

__all__ = [
    # a folder's identity and its checks, and the evaluation (this module)
    "IDENTITY_KEYS",
    "LEGACY_DEFAULTS",
    "MAY_CHANGE_ON_RERUN",
    "EvalSummary",
    "check_folder",
    "check_records",
    "evaluate",
    "question_hashes",
    "run_identity",
    "run_producer",
    # greedy decoding (ncgrpo.eval.decoding)
    "ENGINES",
    "DecodingSettings",
    "engine_of",
    "eval_mode",
    "generate_greedy",
    "score_greedy",
    # the model for an engine (ncgrpo.eval.model_load)
    "ADAPTER_CONFIG",
    "adapter_base",
    "check_adapter_base",
    "check_finite_weights",
    "check_images",
    "config_reads_images",
    "load_adapter",
    "load_for_eval",
    "takes_images",
    # the model id (ncgrpo.eval.model_id)
    "LOAD_OPTIONS",
    "MODEL_ID_FILES",
    "MODEL_ID_RULE",
    "NOT_WEIGHTS",
    "file_sha256",
    "model_id_of",
    "weight_files",
]


@dataclass
class EvalSummary:
    out_dir: Path
    total: int
    newly_recorded: int
    accuracy: dict[str, float] = field(default_factory=dict)  # benchmark -> accuracy in [0, 1]
    counts: dict[str, int] = field(default_factory=dict)


#: run.json keys that may change between reruns into one folder (display names, the batch size). Every
#: other key :func:`run_identity` writes says which outputs the records are, and a rerun must match it,
#: so a new setting is part of the identity with no edit here.
MAY_CHANGE_ON_RERUN = ("name", "method", "batch_size", "kind")  # kind: checked first (check_folder); an
# eval folder written before kinds were recorded gains it on its next rerun


#: Values of identity keys added since folders were first written, for a run.json that lacks them:
#: a folder from before ``engine`` existed was decoded by transformers, and one from before
#: ``model_id_rule`` named its model by the weight files' names and sizes.
LEGACY_DEFAULTS: dict[str, Any] = {"engine": "transformers", "model_id_rule": "weight-sizes"}


def run_identity(
    *,
    model_id: str,
    checkpoint: str | None = None,
    seed: int | None = None,
    name: str | None = None,
    method: str | None = None,
    settings: DecodingSettings | None = None,
    split: str | dict[str, str] | None = None,
    benchmarks: Sequence[str] | None = None,
    engine: str = "transformers",
) -> dict[str, Any]:
    """The run.json content :func:`evaluate` writes for these arguments (``name`` None: the folder's
    name is kept, or the model id for a new folder)."""
    settings = settings or DecodingSettings()
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return {
        "kind": "eval",
        "model": model_id,
        "model_id_rule": MODEL_ID_RULE,
        "engine": engine,
        "checkpoint": checkpoint,
        "seed": seed,
        "split": split,
        "benchmarks": None if benchmarks is None else list(benchmarks),
        "decoding": settings.identity(),
        "name": name,
        "method": method,
        "batch_size": settings.batch_size,
    }


#: The identity keys of an evaluation folder today (run.json keys but :data:`MAY_CHANGE_ON_RERUN`).
IDENTITY_KEYS = tuple(k for k in run_identity(model_id="") if k not in MAY_CHANGE_ON_RERUN)


def check_folder(out_dir: str | Path, run: dict[str, Any]) -> dict[str, Any] | None:
    """Refuse a folder whose run.json has another identity (:data:`IDENTITY_KEYS`) than ``run``.

    Reads only (run.json once): callers check before loading a model. Returns the folder's run.json,
    or None when there is none yet (a new folder).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out}: exists and is not a folder")
    path = out / RUN_FILE
    old = read_run_json(out, hint="move it away or fix it")
    # a train run, a demo's root, a model: never written into
    check_folder_kind(out, "eval", "ncgrpo eval", info=old)
    if old is None:
        return None
    diffs = [
        (k, old.get(k, LEGACY_DEFAULTS.get(k)), run.get(k))
        for k in run
        if k not in MAY_CHANGE_ON_RERUN and old.get(k, LEGACY_DEFAULTS.get(k)) != run.get(k)
    ]
    if diffs:
        why = ""
        if any(k == "model_id_rule" for k, _, _ in diffs):
            why = (
                " (the folder was written before model ids hashed the weights' contents: its records "
                "cannot be shown to be of these weights)"
            )
        raise ValueError(
            f"{path}: this folder holds records of another evaluation: "
            + "; ".join(f"{k} is {was!r} there, {now!r} now" for k, was, now in diffs)
            + f"{why}; use another --output_dir folder (records of different runs must not mix)"
        )
    return old


def run_producer(run: dict[str, Any]) -> dict[str, Any]:
    """:func:`record_producer` of the records :func:`evaluate` writes for run.json content ``run``."""
    decoding = {**LEGACY_DECODING, **(run.get("decoding") or {}), "engine": run.get("engine", "transformers")}
    decoding.pop("batch_size", None)
    return {"model": run["model"], "checkpoint": run["checkpoint"], "seed": run["seed"], "decoding": decoding}


def _field_diffs(was: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, was, now) per differing field; a ``decoding`` dict is compared field by field."""
    out = []
    for k in dict.fromkeys([*was, *now]):
        a, b = was.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [(f"{k}.{f}", x, y) for f, x, y in _field_diffs(a, b)]
        elif a != b:
            out.append((k, a, b))
    return out


def question_hashes(q: Question, settings: DecodingSettings) -> dict[str, str]:
    """What a record says of its question (prompt text hash, figures' pixel hash, gold answer), as
    :func:`evaluate` writes it for ``q`` under ``settings``."""
    msgs = build_messages(q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt)
    return {"prompt_hash": prompt_hash(msgs), "image_hash": image_hash(q.images), "gold": q.answer}


def check_records(
    out_dir: str | Path,
    run: dict[str, Any],
    questions: Sequence[Question],
    settings: DecodingSettings,
) -> None:
    """Refuse to append to a folder whose records were made otherwise: reads ``records.jsonl`` only.

    - every record's producer (:func:`record_producer`: model id, checkpoint, seed, decoding) must be
      the one ``run`` writes: the check holds when run.json is lost or was replaced;
    - a question asked again must be the question recorded (prompt hash, image hash, gold): benchmark
      data changed on disk under the same ids is refused, not completed with other questions;
    - a benchmark keeps the role its records have (``--data NAME=FILE:ROLE``).

    Each message names the differing fields with both values.
    """
    path = Path(out_dir) / RECORDS_FILE
    if not path.exists():
        return
    want = run_producer(run)
    asked = {(q.benchmark, q.question_id): q for q in questions}
    producer_diffs: dict[str, tuple[Any, Any, str]] = {}
    roles: dict[str, str] = {}
    changed: list[str] = []
    n_changed = 0
    for r in iter_records(path):
        for k, was, now in _field_diffs(record_producer(r), want):
            producer_diffs.setdefault(k, (was, now, f"{r.benchmark}/{r.question_id}"))
        roles.setdefault(r.benchmark, r.role)
        q = asked.get(r.key)
        if q is None:
            continue
        h = question_hashes(q, settings)
        diff = [
            f"{k} {getattr(r, k)!r} recorded, {h[k]!r} now"
            for k in ("prompt_hash", "image_hash", "gold")
            if getattr(r, k) and h[k] != getattr(r, k)  # "" in records older than the field: unknown
        ]
        if diff:
            n_changed += 1
            if len(changed) < 3:
                changed.append(f"{r.benchmark}/{r.question_id} ({', '.join(diff)})")
    if producer_diffs:
        raise ValueError(
            f"{path}: these records were made by another evaluation: "
            + "; ".join(
                f"{k} is {a!r} in the records (e.g. {where}), {b!r} now"
                for k, (a, b, where) in producer_diffs.items()
            )
            + "; use another --output_dir folder (records of different runs must not mix)"
        )
    if changed:
        more = f" and {n_changed - len(changed)} more" if n_changed > len(changed) else ""
        raise ValueError(
            f"{path}: {n_changed} recorded question(s) are not the questions asked now under the same ids: "
            f"{'; '.join(changed)}{more}; the benchmark data changed since they were recorded: evaluate into "
            "another --output_dir folder (or restore the data they were recorded on)"
        )
    for q in questions:
        was = roles.get(q.benchmark)
        if was is not None and was != q.role:
            raise ValueError(
                f"{path}: benchmark {q.benchmark!r} is recorded with role {was!r}, not {q.role!r}; "
                "evaluate with the role it had, or into another --output_dir"
            )


def _check_run_file(out_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
    """A folder holds the records of one identity (:data:`IDENTITY_KEYS`): refuse to mix.

    Display fields (``name``, ``method``) given on a rerun are merged in; ``batch_size`` is the
    last one used. A new folder records what made it (``provenance``: :mod:`ncgrpo.runs.provenance`),
    which is not part of its identity (records whose run.json was lost: unknown, not this process).
    Returns the folder's run.json as written.
    """
    old = check_folder(out_dir, run)
    if old is None:
        new = {**run, "name": run["name"] or run["model"]}
        if not (out_dir / RECORDS_FILE).exists():  # records without a run.json: what made them is unknown
            new["provenance"] = provenance()
        atomic_write_json(out_dir / RUN_FILE, new)
        return new
    merged = {**old, **{k: v for k, v in run.items() if v is not None}}
    if merged != old:
        atomic_write_json(out_dir / RUN_FILE, merged)
    return merged


def _append_provenance(out: Path, folder: dict[str, Any], n_new: int) -> dict[str, Any]:
    """Records appended to a folder under other code or packages than its run.json records (another
    commit, another torch, uncommitted source): a ``ProvenanceWarning`` and an entry in run.json's
    ``provenance_history`` (:func:`ncgrpo.runs.provenance.continue_provenance`), not a refusal: the
    folder's identity (model, decoding, questions) is what keeps records of different runs apart."""
    updated = {**folder, **continue_provenance(folder, event="append", where=out, new_records=n_new)}
    if updated != folder:
        atomic_write_json(out / RUN_FILE, updated)
    return updated


def evaluate(
    model: Any,
    processor: Any,
    questions: Sequence[Question],
    out_dir: str | Path,
    *,
    settings: DecodingSettings | None = None,
    engine: str | None = None,
    progress: bool = True,
    **identity: Any,
) -> EvalSummary:
    """Answer ``questions`` greedily and append one record per new question to ``out_dir``.

    ``model`` is a transformers model, or a :class:`~ncgrpo.eval.vllm_engine.VLLMEvalEngine` (from
    :func:`load_for_eval`); ``engine`` (default: the model's) must name the one it is. ``identity``:
    the other keyword arguments of :func:`run_identity` (``model_id`` required; ``checkpoint``,
    ``seed``, ``name``, ``method``, ``split``, ``benchmarks``).

    Already-recorded questions (same benchmark and question id) are skipped, so rerunning after a
    crash completes the folder without duplicates. The folder's identity -- model, checkpoint,
    seed, ``split`` and ``benchmarks`` as given (e.g. the command line's names, so a rerun may add
    questions of those benchmarks) and the decoding settings but the batch size -- is written to
    ``run.json`` and must match on a rerun. The folder is locked
    (:class:`~ncgrpo.runs.folder.FolderLock`) while it is written; the arguments are checked
    before the first byte is written.
    """
    settings = settings or DecodingSettings()
    engine = engine or engine_of(model)
    if engine != engine_of(model):
        raise ValueError(f"engine={engine!r} but the model at hand decodes with {engine_of(model)!r}")
    run_info = run_identity(settings=settings, engine=engine, **identity)
    if not questions:
        raise ValueError("no questions to evaluate")
    check_images(questions, takes_images(model, processor), f"the model ({run_info['model']})")
    uids = [(q.benchmark, q.question_id) for q in questions]
    if len(set(uids)) != len(uids):
        dup = next(u for u in uids if uids.count(u) > 1)
        raise ValueError(f"question {dup[0]}/{dup[1]} appears twice in the evaluation set")
    out = Path(out_dir)
    check_folder(out, run_info)  # refused here, nothing is written (not even the lock file)
    check_records(out, run_info, questions, settings)  # the records too: run.json may be lost
    with FolderLock(out, what="ncgrpo eval"):
        return _evaluate_locked(model, processor, questions, out, run_info, settings, progress)


def _evaluate_locked(
    model: Any,
    processor: Any,
    questions: Sequence[Question],
    out: Path,
    run_info: dict[str, Any],
    settings: DecodingSettings,
    progress: bool,
) -> EvalSummary:
    records_path = out / RECORDS_FILE
    fresh = not (out / RUN_FILE).exists() and not records_path.exists()
    folder = _check_run_file(out, run_info)
    decoding = {**settings.to_dict(), "engine": run_info["engine"]}
    uids = [(q.benchmark, q.question_id) for q in questions]
    repair_torn_tail(records_path)
    done = {r.key for r in iter_records(records_path)} if records_path.exists() else set()
    todo = [q for q in questions if (q.benchmark, q.question_id) not in done]
    if todo and not fresh:
        folder = _append_provenance(out, folder, len(todo))

    from tqdm.auto import tqdm

    new = 0
    transformers = run_info["engine"] == "transformers"
    with (
        eval_mode(model) if transformers else contextlib.nullcontext(),
        RecordWriter(records_path) as writer,
        tqdm(
            total=len(questions),
            initial=len(questions) - len(todo),
            desc=f"eval {out.name}",
            unit="q",
            disable=not progress,
        ) as bar,
    ):
        # (questions, greedy outputs) groups: a transformers batch, or the vLLM requests finished in one
        # engine step; each group is scored and appended (one fsync) as soon as it is decoded
        groups = (
            (
                (batch, generate_greedy(model, processor, batch, settings))
                for batch in question_batches(todo, settings.batch_size)
            )
            if transformers
            else model.stream_greedy(todo, settings)
        )
        for batch, outputs in groups:
            recs = []
            for q, text in zip(batch, outputs, strict=True):
                s = score(
                    text, q.answer, choices=q.choices, answer_type=q.answer_type, grader=settings.grader
                )
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
                        model=run_info["model"],
                        checkpoint=run_info["checkpoint"],
                        seed=run_info["seed"],
                        decoding=decoding,
                        image_hash=image_hash(q.images),
                        name=folder.get("name"),
                        method=folder.get("method"),
                    )
                )
            writer.write(recs)
            new += len(recs)
            bar.update(len(recs))

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
