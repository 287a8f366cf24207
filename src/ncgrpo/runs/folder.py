"""A run folder: its file names, how they are written, who may write, and what is read back.

Every command writes its outputs into one folder; this module is the one place that knows the layout:

- ``run.json`` (:data:`RUN_FILE`): what the folder holds, written atomically (:func:`atomic_write_json`),
  read back by :func:`read_run_json`. A training run (``ncgrpo train``, the demo) records ``name``,
  ``method``, ``seed``, ``model``, ``recipe``, ``output_dir``, ``finished`` (and ``global_step`` once
  finished); an evaluation (``ncgrpo eval``) records its identity (``model``, ``checkpoint``, ``seed``,
  ``split``, ``benchmarks``, ``decoding``) plus ``name``, ``method`` and the last ``batch_size``. Every
  kind records ``provenance`` (what made it: commit, dirty tree, package versions) and, once resumed or
  appended to under another, ``provenance_history`` (:mod:`ncgrpo.runs.provenance`; not identity).
- ``config.yaml`` (:data:`CONFIG_FILE`): a training run's resolved settings, read by ``--resume``.
- ``metrics.jsonl`` (:data:`METRICS_FILE`), ``records.jsonl`` (:data:`RECORDS_FILE`): JSON lines,
  appended and fsync'ed one line at a time, so a kill leaves at most a torn last line
  (:func:`iter_json_lines` skips it, :func:`repair_torn_tail` cuts it).
- ``checkpoint-N/`` (Trainer checkpoints, plus :data:`STATE_FILE` for NC-GRPO's own state): resumed
  from the newest complete one (:func:`last_complete_checkpoint`).
- ``.ncgrpo.lock`` (:data:`LOCK_FILE`): the advisory lock a writer holds (:class:`FolderLock`).

Every folder a command writes has a kind (:data:`KINDS`), recorded as ``run.json``'s ``kind``: ``train``
(``ncgrpo train`` and each of a demo's training runs), ``eval`` (``ncgrpo eval``, a demo's evaluations),
``demo`` (a demo's root), ``pretrain`` (``ncgrpo pretrain``'s model folder) and ``report`` (``compare
--output_dir``, ``plot --output_dir``). A writer claims its folder with ``FolderLock(folder, what, kind=...)``: a folder
of another kind (:func:`folder_kind`, which also infers the kind of folders written before kinds were
recorded) or one another process holds is refused before anything is written, naming what was found.

A run's identity (what must not change when a folder is resumed or appended to) is compared by
:func:`changed_identity`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_FILE",
    "LOCK_FILE",
    "METRICS_FILE",
    "RECORDS_FILE",
    "RUN_FILE",
    "STATE_FILE",
    "KINDS",
    "DiskFullError",
    "FolderBusyError",
    "FolderKindError",
    "FolderLock",
    "check_folder_kind",
    "claim_folder",
    "disk_full_error",
    "clear_train_outputs",
    "folder_kind",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "changed_identity",
    "checkpoint_problem",
    "checkpoint_step",
    "checkpoint_weight_files",
    "iter_json_lines",
    "json_rows",
    "last_complete_checkpoint",
    "read_run_json",
    "repair_torn_tail",
]

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RECORDS_FILE = "records.jsonl"
LOCK_FILE = ".ncgrpo.lock"
#: NC-GRPO's own state in a Trainer checkpoint (noise schedule position, SPSA's ``mu``, ...).
STATE_FILE = "ncgrpo_state.pt"


#: What each folder kind holds (``run.json``'s ``kind``), as messages name it.
KINDS: dict[str, str] = {
    "train": "a training run (ncgrpo train, or one of a demo's runs)",
    "eval": "an evaluation (ncgrpo eval: run.json + records.jsonl)",
    "demo": "a demo's output folder (ncgrpo demo)",
    "pretrain": "a base model built by ncgrpo pretrain",
    "report": "tables and figures (ncgrpo compare --output_dir / ncgrpo plot --output_dir)",
    "model": "a saved model (config.json and weights) that no ncgrpo command wrote",
}


class FolderBusyError(ValueError):
    """Another process holds the advisory lock of an output folder."""


class FolderKindError(ValueError):
    """An output folder holds another command's results (another :data:`KINDS` entry)."""


class DiskFullError(ValueError):
    """A write ran out of room (a full disk, a quota, a file-size limit): :func:`disk_full_error`."""


# --- writing ------------------------------------------------------------------------------------
#: What a write that ran out of room says, where no errno survives (PyTorch's zip writer raises a
#: RuntimeError "file write failed"; safetensors' Rust writer its own error).
_FULL_TEXTS = ("no space left on device", "file too large", "disk quota exceeded", "file write failed")


def _full_reason(exc: BaseException) -> str | None:
    import errno

    full = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in full:
            return f"{os.strerror(e.errno)} (errno {errno.errorcode.get(e.errno, e.errno)})"
        text = str(e).lower()
        if any(t in text for t in _FULL_TEXTS):
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        e = e.__cause__ or e.__context__
    return None


def disk_full_error(exc: BaseException, folder: str | os.PathLike, then: str = "") -> DiskFullError | None:
    """A :class:`DiskFullError` naming ``folder`` and the free space of its file system
    (``shutil.disk_usage``) when ``exc`` (or what caused it) is a write that ran out of room (ENOSPC,
    EDQUOT, EFBIG, or the text PyTorch's and safetensors' writers say it with); else ``None``.
    ``then``: what to do next, appended."""
    import shutil

    why = _full_reason(exc)
    if why is None:
        return None
    where = Path(folder)
    probe = where
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free on its file system"
    except OSError:
        free = "free space unknown"
    tail = f"; {then}" if then else ""
    return DiskFullError(
        f"{where}: writing it failed for lack of room: {why}; {free} (a file-size limit, ulimit -f, "
        f"gives the same error){tail}"
    )


def _umask() -> int:
    # No way to read the umask without setting it (before Linux's /proc "Umask:" line); set it back
    # at once. Called only around file creation, never from threads that create files themselves.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the new one, never a mix.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 less the umask), not the
    0600 of the temporary file it is written through.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# --- reading -----------------------------------------------------------------------------------


def _complete_part(data: bytes) -> tuple[bytes, int]:
    """(the newline-terminated part of ``data``, bytes after it). Writers end every record with a
    newline, so anything after the last one is a torn write: a cut line, possibly cut inside a
    multi-byte UTF-8 character."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], len(data) - cut


def iter_json_lines(path: str | os.PathLike, what: str = "row") -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each complete line of a JSONL file written one line at a time.

    Bytes after the last newline are a torn write and are skipped (the file is not changed); blank
    lines are skipped; a complete line that is not UTF-8, not JSON or not a JSON object is an error
    naming the file and line (``what`` names the kind of row in that message).
    """
    path = Path(path)
    data, _ = _complete_part(path.read_bytes())

    def lines() -> Iterator[tuple[int, str]]:
        for i, raw in enumerate(data.splitlines(), start=1):
            try:
                yield i, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start})") from None

    yield from json_rows(lines(), path, what)


def json_rows(
    lines: Iterable[tuple[int, str]], where: str | os.PathLike, what: str = "row"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank ``(line number, text)``: a line that is not JSON or
    not a JSON object is an error naming ``where`` and the line (``what``: the kind of row)."""
    for i, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}:{i}: a {what} must be a JSON object, got {type(row).__name__}")
        yield i, row


def repair_torn_tail(path: str | os.PathLike) -> int:
    """Cut the bytes after the last newline of ``path`` (a killed writer's torn record), fsync'ed.

    Returns the number of bytes cut (0 when the file ends cleanly or does not exist).
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        _, torn = _complete_part(f.read())
        if torn:
            f.truncate(f.tell() - torn)
            f.flush()
            os.fsync(f.fileno())
    return torn


def read_run_json(folder: str | os.PathLike, *, hint: str | None = None) -> dict[str, Any] | None:
    """The folder's ``run.json`` as a dict, or ``None`` when there is none: the one reader of every
    kind of run folder (training, evaluation, demo). A file that is not UTF-8, not JSON or not a JSON
    object is a ``ValueError`` naming the file (and line), followed by ``hint`` (what to do) if given."""
    path = Path(folder) / RUN_FILE
    if not path.exists():
        return None
    tail = f"; {hint}" if hint else ""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}){tail}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}){tail}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(info).__name__}{tail}")
    return info


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _inferred_kind(folder: Path, info: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """(kind, what it was read from) of a folder: see :func:`folder_kind`."""
    if info is not None and isinstance(info.get("kind"), str):
        return info["kind"], f"{RUN_FILE} says kind {info['kind']!r}"
    run = f"{RUN_FILE} (no kind: written before kinds were recorded)"
    if info is not None and ("decoding" in info or "benchmarks" in info):
        return "eval", f"{run} with 'decoding'/'benchmarks'"
    if info is not None and ("finished" in info or "recipe" in info):
        return "train", f"{run} with 'finished'/'recipe'"

    def has(name: str) -> bool:
        return (folder / name).exists()

    if has(RECORDS_FILE):
        return "eval", f"{RECORDS_FILE} present"
    if has(CONFIG_FILE) or has(METRICS_FILE) or any(folder.glob("checkpoint-[0-9]*")):
        return "train", f"{CONFIG_FILE}, {METRICS_FILE} or checkpoint-N present"
    if (
        has("summary.json")
        or has("suite/suite.json")
        or ((folder / "train").is_dir() and (folder / "eval").is_dir())
    ):
        return "demo", "summary.json, suite/ or train/ + eval/ present"
    if has("pretrain.json"):
        return "pretrain", "pretrain.json present"
    if has("comparison.json") or has("comparison.md"):
        return "report", "comparison.json/.md present"
    if has("config.json") and any(has(w) for w in _WEIGHT_FILES):
        return "model", "config.json and model weights present"
    return None, ""


def folder_kind(folder: str | os.PathLike) -> str | None:
    """The kind of ``folder`` (a :data:`KINDS` key), or ``None`` for a folder no command wrote (absent,
    empty, or holding only other files).

    ``run.json``'s ``kind`` when it has one. A folder written before kinds were recorded (a
    ``run.json`` without ``kind``, or none) is recognised by what it holds, first match wins:

    - ``eval``: ``run.json`` has ``decoding`` or ``benchmarks`` (every ``ncgrpo eval`` wrote both), or
      ``records.jsonl`` is present;
    - ``train``: ``run.json`` has ``finished`` or ``recipe`` (``ncgrpo train`` and the demo's runs wrote
      them), or ``config.yaml``, ``metrics.jsonl`` or a ``checkpoint-N/`` is present;
    - ``demo``: ``summary.json``, ``suite/suite.json``, or both ``train/`` and ``eval/`` sub-folders;
    - ``pretrain``: ``pretrain.json``;
    - ``report``: ``comparison.json`` or ``comparison.md``;
    - ``model``: ``config.json`` beside model weights (a saved model: no command writes into it).

    So an old folder resumes (train, eval, demo) exactly as before, and its ``run.json`` gains its kind
    the next time its own command writes it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return _inferred_kind(folder, read_run_json(folder, hint="move it away or fix it"))[0]


_UNREAD: Any = object()  # check_folder_kind's info when the caller has not read run.json


def check_folder_kind(
    folder: str | os.PathLike, kind: str, what: str = "ncgrpo", *, info: Any = _UNREAD
) -> None:
    """Refuse (:class:`FolderKindError`) to write ``kind`` results into ``folder`` when it is a file or
    holds another kind (:func:`folder_kind`); reads only. ``what``: the command, for the message.
    ``info``: the folder's run.json (None: it has none) when the caller has read it already."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FolderKindError(
            f"{folder} is a file, not a folder; {what} writes a folder there: pass a new folder path"
        )
    if not folder.is_dir():
        return
    if info is _UNREAD:
        info = read_run_json(folder, hint="move it away or fix it")
    found, evidence = _inferred_kind(folder, info)
    if found is None or found == kind:
        return
    raise FolderKindError(
        f"{folder} holds {KINDS.get(found, repr(found))} (kind {found!r}: {evidence}); {what} writes "
        f"{KINDS.get(kind, kind)} and never into another command's folder: pass a new folder"
    )


def changed_identity(old: Mapping[str, Any], new: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """``key: old -> new`` for every identity key whose value differs between two settings mappings
    (a key absent from ``old`` and ``None`` in ``new`` counts as unchanged: a setting added since)."""
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if a != b and not (a is None and k not in old and b is None):
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


# --- checkpoints --------------------------------------------------------------------------------


def checkpoint_weight_files(checkpoint: str) -> list[str]:
    """The model weight files of a Trainer checkpoint (single file or sharded index); [] if none."""
    import json

    single = os.path.join(checkpoint, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(checkpoint, s) for s in shards]
    return []


def checkpoint_step(checkpoint: str | os.PathLike) -> int | None:
    """The ``global_step`` a checkpoint's ``trainer_state.json`` records (None: unreadable)."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as f:
            step = json.load(f).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


#: ``torch.save`` files up to this size are read back whole (every member's CRC-32); a larger one (a
#: big model's optimizer state) only has its zip directory checked, which a write cut short lacks.
CRC_CHECK_MAX_BYTES = 2 << 30


def _zip_problem(path: str) -> str | None:
    """Why a ``torch.save`` file (a zip archive) is not whole, or None: its zip directory (written last)
    is there and every member lies within the file; up to :data:`CRC_CHECK_MAX_BYTES`, every member is
    also read back and its CRC-32 checked. Nothing is unpickled, so any state file is checked safely."""
    import zipfile

    try:
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"{path} is torn ({info.filename} runs past the end of the file)"
            bad = z.testzip() if size <= CRC_CHECK_MAX_BYTES else None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, RuntimeError) as e:
        return f"{path} is torn or unreadable ({type(e).__name__}: {e})"
    return None if bad is None else f"{path} is torn ({bad} fails its CRC check)"


def _safetensors_problem(path: str) -> str | None:
    """Why a safetensors file is not whole, or None: its header parses and every tensor's data ends
    within the file (a write cut short leaves it shorter)."""
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                return f"{path} is torn (its header runs past the end of the file)"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError) as e:
        return f"{path} is torn or unreadable ({type(e).__name__})"
    if 8 + n + end > size:
        return f"{path} is torn ({size} bytes; its tensors end at byte {8 + n + end})"
    return None


def checkpoint_problem(checkpoint: str | os.PathLike, nc_state: bool = False) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or ``None`` if it is complete.

    Complete means every file a resume reads is there and whole: ``trainer_state.json`` parses
    (transformers writes it after the model, optimizer, scheduler and RNG state), the model weights
    exist (a safetensors file or index; a PEFT run's adapter weights), ``optimizer.pt`` unless the
    state says nothing was saved beyond the model, and, with ``nc_state`` (a run of a two-pass method:
    every NC-GRPO method, not vanilla), ``ncgrpo_state.pt`` loads (it is written first, atomically).
    Every file in it is checked, not only for being there (issue 35: a torn ``optimizer.pt`` made
    ``--resume`` die loading it): each ``.pt`` / ``.pth`` / ``.bin`` (optimizer, scheduler, RNG state,
    ``torch.save`` zip archives) reads back with every member's CRC intact, each ``.safetensors`` file's
    header parses and its tensors end within the file, each ``.json`` file parses. Checking the files
    themselves, rather than a manifest written last, needs no change to how transformers writes a
    checkpoint and holds for checkpoints written before; it costs one read of the newest checkpoint's
    state files (those over :data:`CRC_CHECK_MAX_BYTES` get the cheaper structural check only).
    A folder cut short by a kill is incomplete; so is one whose files were torn.
    """
    ckpt = str(checkpoint)
    state_path = os.path.join(ckpt, "trainer_state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        return f"{state_path} is missing or torn ({type(e).__name__})"
    # a PEFT run's checkpoints hold the adapter (adapter_model.*), which is what its resume loads
    other = ("pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
    try:
        weights = checkpoint_weight_files(ckpt)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{ckpt}/model.safetensors.index.json is torn or unreadable ({type(e).__name__})"
    if not weights and not any(os.path.isfile(os.path.join(ckpt, f)) for f in other):
        return f"{ckpt} has no model weights"
    missing = [w for w in weights if not os.path.isfile(w)]
    if missing:
        return f"{missing[0]} is missing (named by the weights index)"
    if not os.path.isfile(os.path.join(ckpt, "optimizer.pt")) and os.path.isfile(
        os.path.join(ckpt, "scheduler.pt")
    ):
        return f"{ckpt} has a scheduler but no optimizer.pt"
    for name in sorted(os.listdir(ckpt)):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            continue
        problem = None
        if name.endswith((".pt", ".pth", ".bin")):
            problem = _zip_problem(path)
        elif name.endswith(".safetensors"):
            problem = _safetensors_problem(path)
        elif name.endswith(".json"):
            try:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError) as e:
                problem = f"{path} is torn or unreadable ({type(e).__name__})"
        if problem:
            return problem
    if nc_state:
        path = os.path.join(ckpt, STATE_FILE)
        try:
            import torch

            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable state file makes the checkpoint unusable
            return f"{path} is missing or unreadable ({type(e).__name__})"
    return None


def last_complete_checkpoint(
    output_dir: str | os.PathLike, nc_state: bool = False
) -> tuple[str | None, list[str]]:
    """``(newest complete checkpoint-N folder or None, [why each newer one was skipped])``."""
    import re

    out = str(output_dir)
    if not os.path.isdir(out):
        return None, []
    steps = []
    for name in os.listdir(out):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isdir(os.path.join(out, name)):
            steps.append((int(m.group(1)), name))
    skipped = []
    for _, name in sorted(steps, reverse=True):
        problem = checkpoint_problem(os.path.join(out, name), nc_state)
        if problem is None:
            return os.path.join(out, name), skipped
        skipped.append(f"{name}: {problem}")
    return None, skipped


#: A training run's outputs that ``ncgrpo train --overwrite`` removes (besides ``checkpoint-N/``): what a
#: new run would otherwise mix with its own (metrics appended to, final weights of another run).
TRAIN_OUTPUTS = (
    METRICS_FILE,
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_config.json",
    "training_args.bin",
)


def clear_train_outputs(folder: str | os.PathLike) -> list[str]:
    """Remove a training run's checkpoints (``checkpoint-N/``), ``metrics.jsonl`` and final weights
    (:data:`TRAIN_OUTPUTS`, weight shards ``model-*.safetensors`` / ``pytorch_model-*.bin``) from
    ``folder``, which must be a training run's (its kind ``train``, :func:`folder_kind`): what
    ``ncgrpo train --overwrite`` does once it holds the folder's lock. Returns the names removed."""
    import re
    import shutil

    folder = Path(folder)
    found = folder_kind(folder)
    if found not in (None, "train"):
        raise FolderKindError(
            f"{folder} holds {KINDS.get(found, found)}; only a training run's files are cleared"
        )
    removed = []
    for p in sorted(folder.iterdir()):
        name = p.name
        if p.is_dir() and not p.is_symlink() and re.fullmatch(r"checkpoint-\d+", name):
            shutil.rmtree(p)
        elif p.is_file() and (
            name in TRAIN_OUTPUTS
            or re.fullmatch(r"(model-\d+-of-\d+\.safetensors|pytorch_model-\d+-of-\d+\.bin)", name)
        ):
            p.unlink()
        else:
            continue
        removed.append(name)
    return removed


# --- one writer per folder -----------------------------------------------------------------------


class FolderLock:
    """Advisory exclusive lock (``fcntl.flock``) on ``DIR/.ncgrpo.lock``, held while writing ``DIR``.

    A second process fails at once with :class:`FolderBusyError` naming the holder (its pid, host and
    command line, written into the lock file). The kernel drops the lock when its holder dies, even by
    SIGKILL, so a stale lock file never blocks a rerun. The lock file stays; it holds only the last
    holder. Re-entrant within one process: an inner lock on a folder this process holds is a no-op.

    ``kind`` (a :data:`KINDS` key): the folder must be new or of that kind (:func:`check_folder_kind`),
    checked before the folder or the lock file is created and again once the lock is held.
    :meth:`check` does the same checks without taking the lock or writing anything (for a command to
    refuse before it loads a model).
    """

    _held: dict[str, int] = {}  # resolved folder -> nesting depth, in this process

    def __init__(self, folder: str | os.PathLike, what: str = "ncgrpo", *, kind: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.what = what
        self.kind = kind
        self._fd: int | None = None
        self._key: str | None = None

    def _busy_error(self, holder: str) -> FolderBusyError:
        return FolderBusyError(
            f"{self.folder} is being written by another process ({holder or 'unknown'}; lock {self.path}); "
            "wait for it to finish or use another output folder"
        )

    def _check_target(self) -> None:
        """A file, or a folder of another kind, is refused (:func:`check_folder_kind`)."""
        if self.kind is not None:
            check_folder_kind(self.folder, self.kind, self.what)
        elif self.folder.exists() and not self.folder.is_dir():
            raise FolderKindError(f"{self.folder} is a file, not a folder; pass a folder path")

    def check(self) -> None:
        """Refuse now what :meth:`acquire` would refuse (a file, another kind, another holder); writes
        nothing."""
        self._check_target()
        holder = self.holder()
        if holder is not None:
            raise self._busy_error(holder)

    def holder(self) -> str | None:
        """Who holds the lock (the lock file's text), or ``None`` when no other process does."""
        import fcntl

        if not self.path.is_file() or str(self.folder.resolve()) in FolderLock._held:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 2000, 0).decode("utf-8", "replace").strip() or "unknown"
        except OSError:
            return None
        finally:
            os.close(fd)  # closing drops a lock taken just now
        return None

    def acquire(self) -> None:
        import fcntl

        key = str(self.folder.resolve())
        if key in FolderLock._held:
            FolderLock._held[key] += 1
            self._key = key
            return
        self._check_target()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 2000, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise self._busy_error(holder) from None
        except OSError as e:  # e.g. a file system without flock support
            os.close(fd)
            raise OSError(
                e.errno, f"{self.path}: cannot take the folder lock ({e.strerror}); use a local folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if self.kind is not None:  # again under the lock: another writer may have finished meanwhile
                check_folder_kind(self.folder, self.kind, self.what)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text(self.what).encode("utf-8", "replace"), 0)
        self._fd = fd
        self._key = key
        FolderLock._held[key] = 1

    def release(self) -> None:
        if self._key is None:
            return
        FolderLock._held[self._key] -= 1
        if FolderLock._held[self._key] == 0:
            del FolderLock._held[self._key]
        self._key = None
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_folder(lock: FolderLock) -> FolderLock:
    """Take ``lock`` (which names a kind) and record that kind as the folder's ``run.json`` where it
    does not say it yet (a new folder, or one written before kinds were recorded): how a command whose
    folder holds no run.json of its own (a demo's root, a report folder) claims it. Returns the lock,
    held; the caller releases it."""
    if lock.kind is None:
        raise ValueError(f"claim_folder: the lock on {lock.folder} names no kind to record")
    lock.acquire()
    try:
        if (read_run_json(lock.folder) or {}).get("kind") != lock.kind:
            atomic_write_json(lock.folder / RUN_FILE, {"kind": lock.kind})
    except BaseException:
        lock.release()
        raise
    return lock


def _holder_text(what: str) -> str:
    """``pid N (what) on host H: command line``: what a refused second writer is told."""
    import shlex
    import socket
    import sys

    try:
        cmd = shlex.join(sys.argv)
    except TypeError:
        cmd = " ".join(map(str, sys.argv))
    if len(cmd) > 1000:  # the start (the command) and the end (the last flags) say most
        cmd = cmd[:400] + " ... " + cmd[-595:]
    return f"pid {os.getpid()} ({what}) on host {socket.gethostname()}: {cmd}\n"
