"""NC-GRPO's state in Trainer checkpoints (``ncgrpo_state.pt``: method, step, the method's own state),
TRL's rollout batch in flight (``rollout_batch.pt``: exact resume inside a rollout batch) and the
renamed-weights workaround for resuming Qwen VL models (completeness of a checkpoint is
:mod:`ncgrpo.runs.folder`'s). Plain functions of the trainer, called from ``NCGRPOTrainer``'s TRL seam
(``_save_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_from_checkpoint``, ``training_step``)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch

from ncgrpo.runs.folder import STATE_FILE, checkpoint_problem, checkpoint_weight_files, disk_full_error


def save_nc_state(trainer, checkpoint_dir: str) -> None:
    """Write ``ncgrpo_state.pt`` (method, step and the method's own state,
    :meth:`~ncgrpo.methods.RolloutMethod.state_dict`: SPSA's ``mu``, the calibrated T0) into a checkpoint
    folder, atomically (a temporary file renamed into place), so it is either whole or absent. Reads
    ``trainer.method``, ``.nc_method``, ``.state.global_step``."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STATE_FILE)
    state = {
        "rollout_method": trainer.method,
        "global_step": trainer.state.global_step,
        **trainer.nc_method.state_dict(trainer),
    }
    _atomic_torch_save(state, path)


def _atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file renamed into place: whole or absent."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ the rollout batch in flight
#: TRL's rollout batch in flight and where the run is inside it, one file per process (``rollout_batch.pt``
#: with one process, ``rollout_batch_{rank}.pt`` with several, as transformers names its RNG state files)
ROLLOUT_FILE = "rollout_batch.pt"
#: what ``rollout_batch.pt`` holds (bumped when that changes; an unknown format is refused)
ROLLOUT_FORMAT = 1


def rollout_file(checkpoint_dir: str | os.PathLike, process_index: int = 0, num_processes: int = 1) -> str:
    """This process's ``rollout_batch*.pt`` in ``checkpoint_dir``."""
    name = ROLLOUT_FILE if num_processes <= 1 else f"rollout_batch_{process_index}.pt"
    return os.path.join(str(checkpoint_dir), name)


def _layout(trainer) -> dict[str, int]:
    """The settings that fix where a micro-step falls inside a rollout batch."""
    a = trainer.args
    return {
        "steps_per_generation": int(a.steps_per_generation),
        "num_iterations": int(trainer.num_iterations),
        "gradient_accumulation_steps": int(a.gradient_accumulation_steps),
        "num_processes": int(trainer.accelerator.num_processes),
    }


def _generate_every(layout: dict[str, int]) -> int:
    """Micro-steps (TRL's ``_step``) between two generations: ``steps_per_generation * num_iterations``."""
    return layout["steps_per_generation"] * layout["num_iterations"]


def _map_tensors(tree: Any, fn) -> Any:
    """``tree`` (TRL's buffered inputs: dicts, lists and tuples of tensors, numbers, None) with ``fn``
    applied to every tensor, in a fixed walk order (dicts in insertion order)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def save_rollout_batch(trainer, checkpoint_dir: str) -> None:
    """Write this process's ``rollout_batch*.pt`` into a checkpoint folder, atomically (every process
    its own file; called before transformers writes the checkpoint's other files, so a checkpoint with a
    valid ``trainer_state.json`` has it).

    GRPO generates once per ``steps_per_generation * num_iterations`` micro-steps and trains the
    optimizer steps in between on TRL's buffered rollout batch (``GRPOTrainer._buffered_inputs``,
    indexed by its micro-step counter ``_step``), which transformers' checkpoint does not hold. A
    checkpoint taken inside a rollout batch keeps that batch (its tensors, on the CPU, with which were on
    the accelerator), ``_step``, the metrics TRL has gathered since its last log line (``_metrics``) and
    transformers' loss since its last log line, so that a resume continues the batch the uninterrupted run
    continues (:func:`load_rollout_batch`). At a rollout-batch boundary the batch is not kept (the next
    micro-step generates anew)."""
    layout = _layout(trainer)
    step = int(trainer._step)
    inside = step % _generate_every(layout) != 0 and trainer._buffered_inputs is not None
    on_device: list[bool] = []

    def to_cpu(t: torch.Tensor) -> torch.Tensor:
        on_device.append(t.device.type != "cpu")
        return t.detach().to("cpu")

    buffered = _map_tensors(list(trainer._buffered_inputs), to_cpu) if inside else None
    tr_loss = getattr(trainer, "_tr_loss", None)
    state = {
        "format": ROLLOUT_FORMAT,
        "global_step": int(trainer.state.global_step),
        "step": step,
        "layout": layout,
        "buffered_inputs": buffered,
        "on_device": on_device,
        "metrics": {k: list(v) for k, v in trainer._metrics["train"].items()},
        "tr_loss": tr_loss.detach().to("cpu") if isinstance(tr_loss, torch.Tensor) else None,
        "globalstep_last_logged": getattr(trainer, "_globalstep_last_logged", None),
    }
    os.makedirs(checkpoint_dir, exist_ok=True)
    a = trainer.accelerator
    _atomic_torch_save(state, rollout_file(checkpoint_dir, a.process_index, a.num_processes))


class RolloutResumeError(ValueError):
    """A checkpoint inside a rollout batch that cannot be continued exactly: refused as it is (the
    driver does not wrap it as a load failure of changed settings)."""


def _refuse(checkpoint: str, why: str) -> ValueError:
    return RolloutResumeError(
        f"resume: {checkpoint} {why}; resuming from it would train another run than the one it was cut "
        "from. Resume from a checkpoint at a rollout-batch boundary (move the later checkpoint-N folders "
        "out of the run folder), or start again with --overwrite"
    )


def load_rollout_batch(trainer, checkpoint: str) -> None:
    """Restore what :func:`save_rollout_batch` kept, on resume (after the Trainer has loaded the
    checkpoint's ``trainer_state.json``): TRL's ``_step`` and buffered rollout batch (each tensor back on
    the device it was on, in its dtype) and the metrics TRL had not logged yet; transformers' loss since its
    last log line is put back at the first micro-step (:func:`restore_pending_loss`: the Trainer sets it
    after loading the checkpoint).

    The data position agrees: the Trainer skips ``(global_step % steps per epoch) *
    gradient_accumulation_steps`` batches of the dataloader, whose every batch is one micro-step (TRL's
    ``RepeatSampler`` repeats a rollout batch's prompts ``steps_per_generation * num_iterations`` times),
    so it resumes at micro-step ``global_step * gradient_accumulation_steps`` of the run, which must be
    ``_step`` inside a batch; that is checked. A checkpoint cut inside a rollout batch whose batch cannot
    be restored (no ``rollout_batch.pt``: written by an ncgrpo before it kept one; another batch layout, a
    forced resume; another format) is refused with a ValueError naming it; at a boundary, TRL generates
    anew, as the uninterrupted run does."""
    layout = _layout(trainer)
    every = _generate_every(layout)
    ga = layout["gradient_accumulation_steps"]
    g = int(trainer.state.global_step)
    where = (
        f"was saved at optimizer step {g}, inside a rollout batch (micro-step {(g * ga) % every} of the "
        f"{every} that steps_per_generation={layout['steps_per_generation']} x "
        f"num_iterations={layout['num_iterations']} make)"
    )
    a = trainer.accelerator
    path = rollout_file(checkpoint, a.process_index, a.num_processes)
    if not os.path.isfile(path):
        if (g * ga) % every != 0:
            raise _refuse(
                checkpoint, f"{where} and holds no {os.path.basename(path)} (the rollout batch in flight)"
            )
        return  # a boundary: the next micro-step generates, as the uninterrupted run's does
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("format") != ROLLOUT_FORMAT:
        raise _refuse(checkpoint, f"holds {path} in format {state.get('format')!r}, not {ROLLOUT_FORMAT}")
    if state.get("global_step") != g:
        raise _refuse(checkpoint, f"holds {path} of optimizer step {state.get('global_step')}, not {g}")
    step = int(state["step"])
    inside = state["buffered_inputs"] is not None
    if inside and state["layout"] != layout:
        changed = ", ".join(
            f"{k} {state['layout'].get(k)} -> {v}" for k, v in layout.items() if state["layout"].get(k) != v
        )
        raise _refuse(checkpoint, f"was saved inside a rollout batch under another batch layout ({changed})")
    if inside and step != g * ga:
        raise _refuse(
            checkpoint,
            f"was saved at TRL micro-step {step}, while the Trainer resumes its data at micro-step {g * ga} "
            f"(global_step {g} x gradient_accumulation_steps {ga}: an epoch whose last optimizer step had "
            "fewer micro-batches)",
        )
    trainer._step = step
    if inside:
        device = a.device
        flags = iter(state["on_device"])
        trainer._buffered_inputs = _map_tensors(
            state["buffered_inputs"], lambda t: t.to(device) if next(flags) else t
        )
    metrics = defaultdict(list)
    metrics.update({k: list(v) for k, v in state["metrics"].items()})
    trainer._metrics["train"] = metrics
    trainer._nc_pending_loss = (state["tr_loss"], state["globalstep_last_logged"])


def restore_pending_loss(trainer) -> None:
    """At the first micro-step after a resume: transformers' loss accumulated since its last log line and
    the step of that line, as the checkpoint held them (the Trainer resets both after loading a
    checkpoint, so a log line after a resume would average fewer steps than the uninterrupted run's)."""
    pending = getattr(trainer, "_nc_pending_loss", None)
    if pending is None:
        return
    trainer._nc_pending_loss = None
    tr_loss, last_logged = pending
    current = getattr(trainer, "_tr_loss", None)
    if tr_loss is not None and isinstance(current, torch.Tensor):
        trainer._tr_loss = tr_loss.to(current.device, current.dtype)
    if last_logged is not None:
        trainer._globalstep_last_logged = int(last_logged)


def checkpoint_write_failed(exc: BaseException, checkpoint: str, main_process: bool = True):
    """The error to raise when writing ``checkpoint`` failed with ``exc``: where it ran out of room (a
    full disk, a quota, a file-size limit: :func:`ncgrpo.runs.folder.disk_full_error`), a
    ``DiskFullError`` naming the folder and the free space, after removing the checkpoint it cut short
    (the main process; never a complete one) so its space is free again and ``--resume`` continues from
    the last complete checkpoint; ``None`` for any other failure (raised as it is)."""
    import shutil

    error = disk_full_error(
        exc,
        checkpoint,
        "the checkpoint cut short was removed; free some space, then rerun with --resume (it continues "
        "from the last complete checkpoint)",
    )
    if error is not None and main_process and os.path.isdir(checkpoint) and checkpoint_problem(checkpoint):
        shutil.rmtree(checkpoint, ignore_errors=True)
    return error


def load_nc_state(trainer, checkpoint: str) -> None:
    """Restore the method's state from a checkpoint folder
    (:meth:`~ncgrpo.methods.RolloutMethod.load_state_dict`: SPSA's ``mu``, the calibrated T0; the other
    methods keep none and do not read the file)."""
    trainer.nc_method.load_state_dict(trainer, os.path.join(checkpoint, STATE_FILE))


def renamed_checkpoint_keys(model) -> dict[str, str]:
    """``{saved name: module name}`` where ``save_pretrained`` renames keys; ``{}`` if it does not."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - other transformers versions
        return {}
    own = dict(model.state_dict())
    by_id = {id(v): k for k, v in own.items()}
    try:
        saved = revert_weight_conversion(model, own)
    except Exception:  # noqa: BLE001 - a model the conversion table cannot handle: leave it to the Trainer
        return {}
    if saved is own:
        return {}
    mapping = {k: by_id[id(v)] for k, v in saved.items() if id(v) in by_id}
    if len(mapping) != len(own) or all(k == v for k, v in mapping.items()):
        return {}  # not a pure renaming (or no renaming): leave it to the Trainer
    return mapping


def load_renamed_checkpoint(trainer, resume_from_checkpoint: str, model) -> bool:
    """Resume model weights for models whose checkpoints use renamed keys; ``False`` (nothing loaded)
    for every other case, which the Trainer's own ``_load_from_checkpoint`` handles.

    transformers 5.23's ``save_pretrained`` writes Qwen2-VL / Qwen2.5-VL weights under their legacy
    hub names (``model.layers.*``, ``visual.*``) while the module is ``model.language_model.*`` /
    ``model.visual.*``; ``Trainer._load_from_checkpoint`` loads the file with a plain non-strict
    ``load_state_dict`` and so silently restores *nothing* (only a missing-keys warning). Here the
    saved names are mapped back through the model's own conversion table
    (``revert_weight_conversion`` applied to its state dict: a pure renaming) before loading.
    Other cases (PEFT, FSDP, DeepSpeed, unrenamed models) go to the Trainer unchanged. Reads
    ``trainer.is_deepspeed_enabled`` / ``.is_fsdp_enabled``; calls ``trainer._issue_warnings_after_load``.
    """
    mapping = renamed_checkpoint_keys(model)
    files = checkpoint_weight_files(resume_from_checkpoint)
    plain = not (trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or hasattr(model, "peft_config"))
    if not (plain and mapping and files):
        return False
    import safetensors.torch

    state = {}
    for f in files:
        for k, v in safetensors.torch.load_file(f, device="cpu").items():
            state[mapping.get(k, k)] = v
    result = model.load_state_dict(state, strict=False)
    del state
    trainer._issue_warnings_after_load(result)
    if result.missing_keys:
        raise RuntimeError(
            f"resume: checkpoint {resume_from_checkpoint} lacks weights {result.missing_keys[:5]}..."
        )
    return True
