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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ncgrpo.data.prompts import build_messages, image_hash, prompt_hash, render_prompt
from ncgrpo.data.types import MATH_PROMPT, Question
from ncgrpo.eval.records import LEGACY_DECODING, EvalRecord, RecordWriter, iter_records, record_producer
from ncgrpo.models import tokenizer_of
from ncgrpo.rewards import Score, score
from ncgrpo.runs.folder import (
    RECORDS_FILE,
    RUN_FILE,
    FolderLock,
    atomic_write_json,
    check_folder_kind,
    read_run_json,
    repair_torn_tail,
)


@dataclass
class DecodingSettings:
    """Greedy decoding, as the paper evaluates (section 4.1).

    ``batch_size`` does not change greedy outputs (up to floating-point noise), so it is not part
    of a run's identity: a rerun with a smaller batch (after running out of memory) may append.
    """

    max_new_tokens: int = 2048
    batch_size: int = 8
    system_prompt: str | None = None
    math_prompt: str = MATH_PROMPT
    #: The answer grader (:data:`ncgrpo.rewards.GRADERS`); it changes outcomes, so it is part of the identity.
    grader: str = "ncgrpo"

    def __post_init__(self) -> None:
        from ncgrpo.rewards import GRADERS

        if self.grader not in GRADERS:
            raise ValueError(f"grader must be one of {', '.join(GRADERS)}, got {self.grader!r}")
        for name in ("max_new_tokens", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["do_sample"] = False
        d["num_beams"] = 1
        return d

    def identity(self) -> dict[str, Any]:
        """The settings that change outputs (all but ``batch_size``)."""
        d = self.to_dict()
        d.pop("batch_size")
        return d


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

#: The decoding engines of ``ncgrpo eval --engine``.
ENGINES = ("transformers", "vllm")

#: How :func:`model_id_of` makes an id (run.json ``model_id_rule``): from the weight files' contents.
#: Folders written before the field existed hashed the weight files' names and sizes only
#: (:data:`LEGACY_DEFAULTS`); appending to them is refused, as their records cannot be shown to be
#: of the weights at hand.
MODEL_ID_RULE = "weights-sha256"

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
        from ncgrpo.runs.provenance import provenance

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
    from ncgrpo.runs.provenance import continue_provenance

    updated = {**folder, **continue_provenance(folder, event="append", where=out, new_records=n_new)}
    if updated != folder:
        atomic_write_json(out / RUN_FILE, updated)
    return updated


@torch.no_grad()
def generate_greedy(
    model: Any, processor: Any, questions: Sequence[Question], settings: DecodingSettings
) -> list[str]:
    """Greedy completions for one batch of questions (left-padded, one ``generate`` call)."""
    texts = [
        render_prompt(processor, q, system_prompt=settings.system_prompt, math_prompt=settings.math_prompt)
        for q in questions
    ]
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


def score_greedy(
    model: Any, processor: Any, questions: Sequence[Question], settings: DecodingSettings
) -> list[tuple[str, Score]]:
    """Greedy completions of one batch (:func:`generate_greedy`) and each one's :class:`Score` by
    ``settings.grader``: the one greedy-then-score step of ``ncgrpo eval``, the demo's validation and
    the embedded base's evaluation (training rewards call the same :func:`ncgrpo.rewards.score`)."""
    outputs = generate_greedy(model, processor, questions, settings)
    return [
        (text, score(text, q.answer, choices=q.choices, answer_type=q.answer_type, grader=settings.grader))
        for q, text in zip(questions, outputs, strict=True)
    ]


@contextmanager
def eval_mode(model: Any) -> Iterator[Any]:
    """``model`` in eval mode inside the block; its own mode (training or not) restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _batches(questions: list[Question], size: int) -> list[list[Question]]:
    # Questions with and without images cannot share a processor call; keep each batch uniform
    # while preserving the input order inside each kind.
    with_img = [q for q in questions if q.images]
    without = [q for q in questions if not q.images]
    out: list[list[Question]] = []
    for group in (with_img, without):
        out.extend(group[i : i + size] for i in range(0, len(group), size))
    return out


def engine_of(model: Any) -> str:
    """The engine a model object decodes with: ``vllm`` for a
    :class:`~ncgrpo.eval.vllm_engine.VLLMEvalEngine`, else ``transformers``."""
    return getattr(model, "engine_name", "transformers")


def takes_images(model: Any, processor: Any) -> bool:
    """Whether the model at hand reads images: a vLLM engine says so itself; a transformers model
    does when its processor has an image processor."""
    if engine_of(model) != "transformers":
        return bool(model.is_vision_language)
    return getattr(processor, "image_processor", None) is not None


def check_images(questions: Sequence[Question], reads_images: bool | None, model_name: str) -> None:
    """Refuse questions with images for a text-only model (``reads_images`` False; None: unknown,
    nothing to check): its prompts would hold image placeholder tokens and no image."""
    if reads_images is False:
        q = next((q for q in questions if q.images), None)
        if q is not None:
            raise ValueError(
                f"{q.uid}: questions have images but {model_name} is text-only (no vision config or "
                "image processor); evaluate a vision-language model, or benchmarks without images"
            )


def config_reads_images(path: str | Path) -> bool | None:
    """Whether the model at ``path`` is a vision-language model, from its config alone (no weights);
    None if the config cannot be read here (the model load then names the problem). A PEFT adapter
    folder is its base model's config."""
    from ncgrpo.models import is_vision_language

    try:
        from transformers import AutoConfig

        import ncgrpo.processors  # noqa: F401  (registers the torchvision-free Qwen VL classes)

        return is_vision_language(AutoConfig.from_pretrained(adapter_base(path) or path))
    except Exception:  # noqa: BLE001 - unreadable here: the model load names the problem
        return None


def load_for_eval(
    path: str | Path,
    *,
    engine: str = "transformers",
    dtype: str = "auto",
    device: str = "auto",
    settings: DecodingSettings | None = None,
    questions: Sequence[Question] = (),
) -> tuple[Any, Any]:
    """``(model, processor)`` for :func:`evaluate` on ``engine``: a transformers model in eval mode, or
    a :class:`~ncgrpo.eval.vllm_engine.VLLMEvalEngine` sized for ``questions`` and ``settings``."""
    base = adapter_base(path)
    if engine == "vllm":
        if base is not None:
            raise ValueError(
                f"{path} is a PEFT adapter folder (adapter_config.json, base {base}); --engine vllm loads full "
                "weights: evaluate it with --engine transformers (the adapter is merged into its base on load), "
                "or save PeftModel.from_pretrained(base, path).merge_and_unload() and evaluate that folder"
            )
        from ncgrpo.eval.vllm_engine import load_vllm_engine

        return load_vllm_engine(
            path, dtype=dtype, device=device, settings=settings or DecodingSettings(), questions=questions
        )
    if engine != "transformers":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    from ncgrpo.models import load_model_and_processor

    if base is not None:
        model, processor = load_adapter(path, base, dtype=dtype, device=device)
    else:
        model, processor = load_model_and_processor(path, dtype=dtype, device=device)
    check_finite_weights(model, path)
    return model, processor


def check_finite_weights(model: Any, path: str | Path) -> None:
    """A model (an adapter merged into its base included) whose weights hold a NaN or inf is a
    ``ValueError`` naming the first such parameter: it would answer every question with the same
    token and be scored as a model that knows nothing."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(
                    f"{path}: the model's weights hold non-finite values (NaN or inf in {name}); a diverged or "
                    "damaged checkpoint: evaluate an earlier one"
                )


#: What ``save_pretrained`` of a PEFT model writes beside the adapter weights.
ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(path: str | Path) -> str | None:
    """The base model a PEFT adapter folder names (``adapter_config.json``'s ``base_model_name_or_path``;
    ``ncgrpo train --use_peft true`` writes its run folder so), or None for anything else (a model
    folder: one with its own ``config.json``)."""
    folder = Path(path)
    f = folder / ADAPTER_CONFIG
    if not f.is_file() or (folder / "config.json").is_file():
        return None
    import json

    try:
        base = json.loads(f.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{f}: cannot read the adapter's config ({e})") from None
    if not base:
        raise ValueError(
            f"{f} names no base_model_name_or_path; the adapter cannot be loaded without its base"
        )
    return str(base)


def check_adapter_base(path: str | Path) -> None:
    """A PEFT adapter folder whose base model is a path that is not there (moved or deleted since the
    adapter was trained) is a ``ValueError`` naming the base and ``adapter_config.json``; anything else
    passes (a hub id is left to the load)."""
    base = adapter_base(path)
    if base is not None and base.startswith((".", "/", "~")) and not Path(base).expanduser().exists():
        raise ValueError(
            f"{path}: the adapter's base model {base} (base_model_name_or_path in {Path(path) / ADAPTER_CONFIG}) "
            "does not exist here; put the base model back there, or set base_model_name_or_path to where it "
            "is now"
        )


def load_adapter(
    path: str | Path, base: str, *, dtype: str = "auto", device: str = "auto"
) -> tuple[Any, Any]:
    """``(model, processor)`` of a PEFT adapter folder: its base loaded as
    :func:`ncgrpo.models.load_model_and_processor` loads a model, the adapter applied
    (``PeftModel.from_pretrained``) and merged into the weights (``merge_and_unload``), so evaluation
    runs the plain model the adapter defines. The processor saved beside the adapter (``ncgrpo train``
    saves it there) is used when the folder has one, else the base's."""
    from ncgrpo.models import load_model_and_processor, load_processor

    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError(
            f"{path} is a PEFT adapter folder; loading it needs peft: pip install 'ncgrpo[peft]'"
        ) from None
    check_adapter_base(path)
    model, processor = load_model_and_processor(base, dtype=dtype, device=device)
    model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    model.eval()
    folder = Path(path)
    if any(
        (folder / f).is_file()
        for f in ("processor_config.json", "preprocessor_config.json", "tokenizer.json")
    ):
        processor = load_processor(folder, config=model.config)
    return model, processor


#: The small files of a model folder that change what it answers (config, tokenizer, chat template,
#: processor); their bytes are part of :func:`model_id_of`. Training state (``trainer_state.json``,
#: ``optimizer.pt``, ``training_args.bin``, ...) is not.
MODEL_ID_FILES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)
#: ``*.bin`` files of a checkpoint that are not weights.
NOT_WEIGHTS = frozenset({"training_args.bin"})

_HASHES: dict[tuple[str, int, int, int, int], str] = {}  # (path, size, mtime_ns, inode, device) -> sha256


def weight_files(path: str | Path) -> list[Path]:
    """The weight files of a model folder: ``*.safetensors`` and ``*.bin`` (full models and PEFT
    adapters, sharded or not; not ``training_args.bin``), sorted by name."""
    p = Path(path)
    found = [*p.glob("*.safetensors"), *p.glob("*.bin")]
    return sorted(f for f in found if f.is_file() and f.name not in NOT_WEIGHTS)


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    """sha256 hex of a file's bytes, read in ``chunk``-byte pieces (a 15 GB shard never sits in memory).
    Cached for the process by (path, size, mtime, inode): a model's weights are read once per
    evaluation, and a rewritten file (``train --overwrite``) changes its mtime and is read again."""
    f = Path(path)
    st = f.stat()
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    got = _HASHES.get(key)
    if got is None:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                h.update(block)
        got = _HASHES[key] = h.hexdigest()
    return got


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a cached hub model (the revision ``from_pretrained`` loads offline),
    or None when there is none here."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, not a repo id: the id is the name alone
        return None


#: keys ``save_pretrained`` copies into a tokenizer's or processor's JSON from how it was LOADED (hub
#: access options), which change no answer: a model saved in a process with ``HF_HUB_OFFLINE`` set writes
#: ``"local_files_only": true``, the same model saved elsewhere ``false``
LOAD_OPTIONS = frozenset(
    {"local_files_only", "cache_dir", "token", "use_auth_token", "force_download", "proxies"}
)


def _answer_bytes(f: Path) -> bytes:
    """What of a small model file can change an answer: a JSON file without :data:`LOAD_OPTIONS` (keys
    sorted), any other file as it is."""
    data = f.read_bytes()
    if f.suffix != ".json":
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data  # not JSON after all: hashed as it is
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in LOAD_OPTIONS}
    return json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()


def model_id_of(path: str | Path) -> str:
    """A short stable id for a model folder: its name, ``@``, and 12 hex digits of a sha256 over the
    contents of its weight files (:func:`weight_files`) and of the small files that change its
    answers (:data:`MODEL_ID_FILES`). Two folders of the same name with other weights (another seed,
    a retrained run) get other ids; a PEFT adapter folder's id includes its base model's. A hub id is hashed from its cached snapshot (``ID@hash``: another
    revision is another model); one not cached here is its own id."""
    p = Path(path)
    label = p.name
    if not p.exists():
        snapshot = _hub_snapshot(str(path))
        if snapshot is None:
            return str(path)
        p, label = snapshot, str(path)  # a cached hub id: the revision on disk, by its contents
    h = hashlib.sha256(f"ncgrpo model id ({MODEL_ID_RULE})\n".encode())
    for small in MODEL_ID_FILES:
        f = p / small
        if f.is_file():
            h.update(f"{small}\0{hashlib.sha256(_answer_bytes(f)).hexdigest()}\n".encode())
    for w in weight_files(p):
        h.update(f"{w.name}\0{w.stat().st_size}\0{file_sha256(w)}\n".encode())
    try:
        base = adapter_base(p)
    except ValueError:  # an unreadable adapter config: the load names it
        base = None
    if base is not None:  # a PEFT adapter is its base's weights too
        h.update(f"base\0{model_id_of(base)}\n".encode())
    return f"{label}@{h.hexdigest()[:12]}"


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
                for batch in _batches(todo, settings.batch_size)
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
