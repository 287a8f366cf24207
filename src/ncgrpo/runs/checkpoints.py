"""A training run's checkpoints: which files make one complete (every file a resume reads there and
whole), the newest complete one to resume from, and clearing a training run's outputs for
``ncgrpo train --overwrite``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

from ncgrpo.runs.files import METRICS_FILE, STATE_FILE
from ncgrpo.runs.kinds import KINDS, FolderKindError, folder_kind

__all__ = [
    "CRC_CHECK_MAX_BYTES",
    "TRAINER_STATE_KEYS",
    "TRAIN_OUTPUTS",
    "checkpoint_problem",
    "checkpoint_step",
    "checkpoint_weight_files",
    "clear_train_outputs",
    "last_complete_checkpoint",
]


def checkpoint_weight_files(checkpoint: str) -> list[str]:
    """The model weight files of a Trainer checkpoint (single file or sharded index); [] if none."""

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


#: What a checkpoint's ``trainer_state.json`` must hold for ``Trainer.train(resume_from_checkpoint=...)``
#: to resume from it (``TrainerState.load_from_json`` fills a missing key with its default, ``None`` for
#: ``train_batch_size``, and the resume then dies in arithmetic on it): key -> (types, what it is).
TRAINER_STATE_KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "global_step": ((int,), "a step count"),
    "max_steps": ((int,), "a step count"),
    "train_batch_size": ((int,), "a batch size"),
    "epoch": ((int, float), "a number"),
    "log_history": ((list,), "a list"),
}


def _trainer_state_problem(state: Any) -> str | None:
    """Why a parsed ``trainer_state.json`` cannot be resumed from (:data:`TRAINER_STATE_KEYS`), or None."""
    if not isinstance(state, dict):
        return f"holds no JSON object (a {type(state).__name__})"
    missing = [k for k in TRAINER_STATE_KEYS if k not in state]
    if missing:
        return f"lacks {', '.join(missing)} (a trainer state written by Trainer holds them)"
    for key, (types, what) in TRAINER_STATE_KEYS.items():
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"has {key} {value!r}, not {what}"
    if state["global_step"] < 0:
        return f"has global_step {state['global_step']}, below 0"
    return None


def _nonfinite_problem(path: str) -> str | None:
    """Why a safetensors file's floating-point tensors are not all finite (a NaN or inf: a diverged or
    damaged adapter, which a resume would train from and the noise hook then refuse), or None. Read one
    tensor at a time."""
    try:
        # imported here: torch is the one heavy import of this module (the CLI's light commands read
        # run folders without it), needed only for an adapter's values
        import torch
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                t = f.get_tensor(key)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return f"{path} holds non-finite values (NaN or inf in {key})"
    except Exception as e:  # noqa: BLE001 - a file safetensors cannot read is not whole either
        return f"{path} is unreadable ({type(e).__name__})"
    return None


def checkpoint_problem(checkpoint: str | os.PathLike, nc_state: bool = False) -> str | None:
    """Why ``checkpoint`` cannot be resumed from, or ``None`` if it is complete.

    Complete means every file a resume reads is there and whole: ``trainer_state.json`` parses
    (transformers writes it after the model, optimizer, scheduler and RNG state) and holds the keys a
    resume reads (:data:`TRAINER_STATE_KEYS`), the model weights
    exist (a safetensors file or index; a PEFT run's adapter weights), ``optimizer.pt`` unless the
    state says nothing was saved beyond the model, and, with ``nc_state`` (a run of a two-pass method:
    every NC-GRPO method, not vanilla), ``ncgrpo_state.pt`` loads (it is written first, atomically).
    Every file in it is checked, not only for being there (issue 35: a torn ``optimizer.pt`` made
    ``--resume`` die loading it): each ``.pt`` / ``.pth`` / ``.bin`` (optimizer, scheduler, RNG state,
    ``torch.save`` zip archives) reads back with every member's CRC intact, each ``.safetensors`` file's
    header parses and its tensors end within the file (an adapter's, ``adapter_model.safetensors``, also
    holds only finite values), each ``.json`` file parses. Checking the files
    themselves, rather than a manifest written last, needs no change to how transformers writes a
    checkpoint and holds for checkpoints written before; it costs one read of the newest checkpoint's
    state files (those over :data:`CRC_CHECK_MAX_BYTES` get the cheaper structural check only).
    A folder cut short by a kill is incomplete; so is one whose files were torn.
    """
    ckpt = str(checkpoint)
    state_path = os.path.join(ckpt, "trainer_state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        return f"{state_path} is missing or torn ({type(e).__name__})"
    problem = _trainer_state_problem(state)
    if problem:
        return f"{state_path} {problem}"
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
            if problem is None and name.startswith("adapter_model"):
                problem = _nonfinite_problem(path)
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
