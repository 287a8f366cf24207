"""NC-GRPO's state in Trainer checkpoints (``ncgrpo_state.pt``: method, step, the method's own state)
and the renamed-weights workaround for resuming Qwen VL models (completeness of a
checkpoint is :mod:`ncgrpo.runs.folder`'s). Plain functions of the trainer, called from
``NCGRPOTrainer``'s TRL seam (``_save_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_from_checkpoint``)."""

from __future__ import annotations

import os

import torch

from ncgrpo.runs.folder import STATE_FILE, checkpoint_problem, checkpoint_weight_files, disk_full_error


def save_nc_state(trainer, checkpoint_dir: str) -> None:
    """Write ``ncgrpo_state.pt`` (method, step and the method's own state,
    :meth:`~ncgrpo.methods.RolloutMethod.state_dict`: SPSA's ``mu``, the calibrated T0) into a checkpoint
    folder, atomically (a temporary file renamed into place), so it is either whole or absent. Reads
    ``trainer.method``, ``.nc_method``, ``.state.global_step``."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    path = os.path.join(checkpoint_dir, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    state = {
        "rollout_method": trainer.method,
        "global_step": trainer.state.global_step,
        **trainer.nc_method.state_dict(trainer),
    }
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
