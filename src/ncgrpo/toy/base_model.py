"""The embedded base model: :func:`ensure_base_model` (the committed checkpoint, else one built into a
cache by :func:`ncgrpo.toy.pretrain.pretrain`) and ``ncgrpo pretrain``'s settings (:class:`PretrainConfig`,
:func:`run_pretrain`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ncgrpo
from ncgrpo.runs.folder import LOCK_FILE, RUN_FILE, FolderLock, atomic_write_json
from ncgrpo.runs.provenance import provenance
from ncgrpo.toy.pretrain import (
    ASSET_DIR,
    DEFAULT_FINAL_STEPS,
    DEFAULT_FOCUS_FAMILIES,
    DEFAULT_FOCUS_STEPS,
    DEFAULT_LATE_LR,
    DEFAULT_POOL,
    DEFAULT_STEPS,
    DEFAULT_VISION_LR_SCALE,
    DEFAULT_VISION_WARMUP,
    PRETRAIN_FILE,
    SIZES,
    VISION_BATCH,
    PretrainReport,
    _check_recipe,
    pretrain,
)
from ncgrpo.toy.traces import DIRECT_SHARE, SHORTCUT_ANSWERS
from ncgrpo.toy.vision_warmup import VISION_MIX

__all__ = ["PretrainConfig", "ensure_base_model", "run_pretrain"]


# --------------------------------------------------------------------------------- base model


def _recipe_hash() -> str:
    """Identity of what :func:`~ncgrpo.toy.pretrain.pretrain` builds by default: version, sizes, pool, steps and the
    warm-up traces' mix (shortcut share and answers), so a cached base built from other traces is
    not reused."""

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
    """A blocking ``flock`` on ``path``: a second builder (another process or thread) waits for the first
    and then finds its build. Not :class:`ncgrpo.runs.folder.FolderLock`, which refuses a second writer at
    once and is re-entrant within a process (two threads would both build)."""
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

    The checkpoint committed under ``src/ncgrpo/toy/assets/base`` (:data:`~ncgrpo.toy.pretrain.ASSET_DIR`) when it is there
    (and ``use_asset``);
    otherwise ``cache_dir`` (default ``~/.cache/ncgrpo``) ``/base-<recipe hash>``, built by
    :func:`~ncgrpo.toy.pretrain.pretrain` with the default recipe on first use. Concurrent callers serialise on a lock
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
        build_into(target, pretrain, prefix=".base-build-")
    return target


def build_into(target: Path, build, *, prefix: str) -> None:
    """``build(folder)`` into a fresh temporary folder beside ``target``, then renamed into place (a stale,
    incomplete ``target`` from an interrupted older build is removed first): a reader never sees half a
    build. Call it under :func:`_file_lock`."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        build(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------ command line
@dataclass
class PretrainConfig:
    """What ``ncgrpo pretrain`` runs: :func:`~ncgrpo.toy.pretrain.pretrain`'s settings, one flag (and config key) each."""

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
    """:func:`~ncgrpo.toy.pretrain.pretrain` with ``cfg``'s settings, into a new or empty ``cfg.output_dir``, holding its lock
    (:class:`ncgrpo.runs.folder.FolderLock`, kind ``pretrain``: a second pretrain into it fails at once,
    naming the first). Only the lock file and a ``run.json`` of an interrupted pretrain may be there."""

    lock = FolderLock(cfg.output_dir, "ncgrpo pretrain", kind="pretrain")
    lock.check()
    ours = {LOCK_FILE, RUN_FILE}
    if cfg.output_dir.is_dir() and any(p.name not in ours for p in cfg.output_dir.iterdir()):
        raise ValueError(f"{cfg.output_dir} exists and is not empty; pass a new --output_dir folder")
    with lock:
        made = {"kind": "pretrain", "provenance": provenance()}  # what made the model (commit, versions)
        atomic_write_json(cfg.output_dir / RUN_FILE, {**made, "finished": False})
        report = _run_pretrain(cfg, progress)
        atomic_write_json(cfg.output_dir / RUN_FILE, {**made, "finished": True})
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
