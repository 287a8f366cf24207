"""Preparing and executing one training run into its folder, shared by ``ncgrpo train`` and the
embedded demo: the datasets (:func:`build_datasets`), the resolved run (:class:`RunPlan`, made by
``ncgrpo train``'s ``prepare_run``), the model and its LoRA adapter (:func:`load_model`,
:func:`peft_config_for`), the metrics file (:class:`MetricsCallback`) and the run driver
(:func:`train_run`, :func:`execute_run`). It builds an ``NCGRPOTrainer``, so it sits above the trainer;
the folder's layout is :mod:`ncgrpo.runs.folder`.

``model_args`` below is ``ncgrpo train``'s ``ModelArguments`` (a ``trl.ModelConfig`` with the vision
settings ``dtype``, ``freeze_vision_tower``, ``min_pixels``, ``max_pixels``) and ``script_args`` its
``ScriptArguments`` (data and rewards), both of :mod:`ncgrpo.commands.train_settings`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate import PartialState
from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import ModelConfig, get_peft_config

from ncgrpo import models  # models.load_model_and_processor: looked up at the call (tests stand in for it)
from ncgrpo.data.benchmarks import load_benchmark
from ncgrpo.data.files import is_data_file, read_data_file
from ncgrpo.data.geometry3k import load_geometry3k, to_trl_dataset
from ncgrpo.models import find_vision_tower
from ncgrpo.rewards.loading import BUILTIN_REWARDS, resolve_reward
from ncgrpo.runs.folder import (
    CONFIG_FILE,
    METRICS_FILE,
    RUN_FILE,
    DiskFullError,
    FolderLock,
    atomic_write_json,
    atomic_write_text,
    checkpoint_step,
    clear_train_outputs,
    disk_full_error,
    read_run_json,
)
from ncgrpo.runs.provenance import continue_provenance
from ncgrpo.trainer import NCGRPOTrainer
from ncgrpo.trainer.checkpoints import RolloutResumeError
from ncgrpo.trainer.run_folder import MetricsCallback, write_train_run_json

__all__ = [
    "MetricsCallback",
    "RunPlan",
    "build_datasets",
    "execute_run",
    "load_model",
    "peft_config_for",
    "reward_functions",
    "train_run",
]


# ------------------------------------------------------------------------------------ pipeline
def _questions(
    name: str, path: str | None, split: str, limit: int | None, seed: int, output_dir: Path, synthetic
):
    if name not in ("geo3k", "synthetic"):  # a built-in text benchmark (gsm8k, math500): its own loader
        return load_benchmark(name, path, split=split, limit=limit)
    if name == "synthetic" and path is None:
        folder = output_dir / "synthetic-data"
        if not (folder / "data").is_dir():
            if synthetic is None:
                raise ValueError(
                    "dataset_name synthetic with no dataset_path needs a suite generator; pass dataset_path "
                    "(a folder written by ncgrpo.toy.suite.export_geo3k)"
                )
            synthetic(folder, seed)
        path = str(folder)
    return load_geometry3k(path, split, limit=limit)


def _file_dataset(path: str, script_args: Any, limit: int | None, what: str):
    """A data file's rows (the first ``limit``) as TRL's conversational dataset; a built-in reward's
    ``answer`` column checked in every row."""

    s = script_args
    data = read_data_file(path, s.prompt_column, what=what)
    if limit is not None:
        data.rows = data.rows[:limit]
        data.lines = data.lines[:limit] if data.lines is not None else None
    answer = s.answer_column or "answer"
    builtin = [r for r in s.reward_funcs if r in BUILTIN_REWARDS and r != "format_reward"]
    if builtin:
        data.check_column(
            answer,
            what=f"the gold answer that {', '.join(builtin)} reads"
            + ("" if s.answer_column else "; name the column holding it with --answer_column"),
        )
    return data.to_trl_dataset(
        system_prompt=s.system_prompt,
        math_prompt=s.math_prompt,
        answer_column=s.answer_column,
        answer_text=bool(builtin),
    )


def build_datasets(
    script_args: Any,  # ScriptArguments
    output_dir: str | os.PathLike,
    *,
    seed: int = 42,
    synthetic: Callable[[Path, int], Any] | None = None,
):
    """(train dataset, eval dataset / dict of them / None) in the form ``to_trl_dataset`` makes.

    ``synthetic(folder, seed)`` writes the synthetic suite (geo3k layout) into ``folder``; it is called
    when ``dataset_name`` is synthetic and no path is given (``ncgrpo train`` passes the toy suite's).
    A data file of one's own (``dataset_name`` / ``eval_dataset_name`` ending in .jsonl, .json or
    .parquet) is read by :func:`ncgrpo.data.files.read_data_file`: TRL's conversational prompts from
    ``prompt_column``, every other column kept for the reward functions.
    """

    out = Path(output_dir)
    kwargs: dict[str, Any] = {"system_prompt": script_args.system_prompt}
    if script_args.math_prompt is not None:
        kwargs["math_prompt"] = script_args.math_prompt

    def build(name, path, split, limit):
        if is_data_file(name):
            return _file_dataset(name, script_args, limit, what)
        return to_trl_dataset(_questions(name, path, split, limit, seed, out, synthetic), **kwargs)

    s = script_args
    what = "dataset_name"
    train = build(s.dataset_name, s.dataset_path, s.dataset_train_split, s.dataset_train_limit)
    what = "eval_dataset_name"
    if s.eval_dataset_name is not None and is_data_file(s.eval_dataset_name):
        evals = {Path(s.eval_dataset_name).stem: build(s.eval_dataset_name, None, None, s.eval_dataset_limit)}
    else:
        evals = {
            f"{s.eval_name}_{split}": build(s.eval_name, s.eval_path, split, s.eval_dataset_limit)
            for split in dict.fromkeys(s.eval_dataset_splits)
        }
    if not evals:
        return train, None
    return train, (next(iter(evals.values())) if len(evals) == 1 else evals)


@dataclass
class RunPlan:
    """A resolved run, ready to train: what ``ncgrpo train``'s
    :func:`ncgrpo.commands.train_prepare.prepare_run` returns."""

    name: str
    method: str
    seed: int
    output_dir: Path
    checkpoint: str | None  # resume from here (None: from scratch)
    script_args: Any  # ScriptArguments
    model_args: Any  # ModelArguments
    training_args: Any  # NCGRPOConfig
    train_dataset: Any
    eval_dataset: Any
    run_info: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    main_process: bool = True  # this process writes files and prints
    lock: Any = None  # the folder's FolderLock, taken by write_folder(), held until release()
    config_text: str = ""  # the resolved config.yaml
    staging: Path | None = None  # a generated synthetic suite, moved into the folder by write_folder()
    dry_run: bool = False
    keep: bool = False  # a dry run into a folder that holds a run: its files are left as they are
    seen: Any = None  # the folder's run.json and checkpoints as prepare_run checked them (_folder_state)
    overwrite: bool = False  # start the run again: its checkpoints, metrics, final weights are removed

    def write_folder(self) -> None:
        """Take the folder's lock and write ``config.yaml``, ``run.json`` and the generated data (the
        main process; ``prepare_run`` calls it at the end of a dry run, :func:`execute_run` once the
        model has loaded). The lock stays held until :meth:`release`. A folder whose ``run.json`` or
        checkpoints changed since ``prepare_run`` checked them (another run wrote it while this one
        loaded its model) is refused, so its checks hold under the lock."""

        try:
            if self.main_process and not self.keep:
                self.lock.acquire()
                if self.seen is not None and _folder_state(self.output_dir) != self.seen:
                    raise ValueError(
                        f"{self.output_dir} changed while the model loaded (another process wrote its "
                        f"{RUN_FILE} or checkpoints); check what is there, then rerun (or use another --output_dir)"
                    )
                if self.overwrite:
                    self._clear()
                if self.staging is not None:
                    target = self.output_dir / "synthetic-data"
                    if self.overwrite and target.exists():
                        shutil.rmtree(target)  # generated for the old run's seed: this run makes its own
                    if not target.exists():
                        # moved beside its place first (a copy when /tmp is another filesystem), then
                        # renamed: a kill mid-copy leaves only the partial folder, which the next run clears
                        partial = self.output_dir / ".synthetic-data.partial"
                        shutil.rmtree(partial, ignore_errors=True)
                        shutil.move(str(self.staging / "synthetic-data"), str(partial))
                        os.replace(partial, target)
                if not self.resuming:
                    self.write_settings()
                    atomic_write_json(self.output_dir / RUN_FILE, self.run_info)
        except BaseException:
            self.release()
            raise
        finally:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging = None

    @property
    def resuming(self) -> bool:
        """A real run resumed from a checkpoint: its ``config.yaml`` and ``run.json`` still describe the
        checkpoint's run until the checkpoint has loaded into this run's model (:func:`train_run`'s
        ``on_loaded``), so a resume that fails to load it (``--force`` with a changed ``lora_r``, a
        dropped ``use_peft``) leaves the run's own settings recorded."""
        return self.checkpoint is not None and not self.dry_run

    def write_settings(self) -> None:
        """Write the resolved ``config.yaml`` (the main process, under the folder's lock)."""
        if self.main_process:
            atomic_write_text(self.output_dir / CONFIG_FILE, self.config_text)

    def _clear(self) -> None:
        """``--overwrite``, under the lock: mark ``run.json`` (``overwriting``: a kill part way leaves a
        folder ``--resume`` refuses) then remove the old run's checkpoints, metrics and final weights
        (:func:`ncgrpo.runs.folder.clear_train_outputs`); ``write_folder`` then writes the new run's files."""

        atomic_write_json(
            self.output_dir / RUN_FILE, {**self.run_info, "finished": False, "overwriting": True}
        )
        removed = clear_train_outputs(self.output_dir)
        if removed:
            print(
                f"ncgrpo train: --overwrite: removed {', '.join(removed)} from {self.output_dir}",
                file=sys.stderr,
            )

    def release(self) -> None:
        """Let go of the run folder (:func:`execute_run` does at its end) and of a staged suite never
        written; idempotent."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        if self.lock is not None:
            self.lock.release()

    @property
    def n_eval(self) -> int:
        ev = self.eval_dataset
        if ev is None:
            return 0
        return sum(map(len, ev.values())) if isinstance(ev, dict) else len(ev)


def _folder_state(output_dir: Path) -> tuple[bytes | None, tuple[str, ...]]:
    """What ``ncgrpo train``'s ``prepare_run`` folder checks read: ``run.json``'s bytes and the
    checkpoint names."""
    run_json = output_dir / RUN_FILE
    data = run_json.read_bytes() if run_json.is_file() else None
    return data, tuple(sorted(p.name for p in output_dir.glob("checkpoint-*")))


# ------------------------------------------------------------------------------ metrics and the driver
def train_run(
    args,
    model,
    processor,
    train_dataset,
    *,
    reward_funcs,
    run_info: dict[str, Any],
    eval_dataset=None,
    callbacks: Sequence[Any] = (),
    resume_from_checkpoint: str | None = None,
    console_logs: bool = True,
    peft_config=None,
    on_loaded: Callable[[], None] | None = None,
):
    """One training run into ``args.output_dir``, the same for ``ncgrpo train`` and the demo.

    The main process holds the folder's lock (:class:`ncgrpo.runs.folder.FolderLock`, kind ``train``)
    throughout: a folder of another kind (an evaluation, a demo's root, a saved model) or one another
    process is writing is refused before anything is written. Writes ``run.json`` (``run_info`` plus
    ``kind: train``, ``finished: false`` and, where ``run_info`` has none, this process's ``provenance``:
    :mod:`ncgrpo.runs.provenance`; :func:`~ncgrpo.trainer.run_folder.write_train_run_json`, the trainer's
    own record switched off) before training; the trainer's own :class:`MetricsCallback` appends every
    log call to ``metrics.jsonl``; trains (from ``resume_from_checkpoint`` if
    given), saves the final model and processor to the folder and rewrites ``run.json`` with
    ``global_step`` and ``finished: true`` last, so a folder whose ``run.json`` says finished holds a
    complete model. Only the main process writes. ``console_logs=False`` removes TRL's per-step
    printing (a caller with its own progress display). ``peft_config``: given to the trainer (TRL wraps
    the model; the folder then holds the adapter). With ``resume_from_checkpoint``, ``run.json`` is
    written (and ``on_loaded`` called: ``ncgrpo train`` writes its ``config.yaml`` there) only once the
    checkpoint has loaded into the model (its weights, optimizer, trainer state and NC-GRPO state); a
    checkpoint that does not load is a ``ValueError`` saying so, with the folder's files unchanged.
    Returns the trainer.
    """

    out = Path(args.output_dir)
    state = PartialState()
    lock = FolderLock(out, "ncgrpo train", kind="train")
    if state.is_main_process:
        lock.acquire()  # re-entrant: a no-op where ncgrpo train's prepare_run holds it already
    try:
        return _train_locked(
            args, model, processor, train_dataset, out=out, main_process=state.is_main_process,
            reward_funcs=reward_funcs, run_info=run_info, eval_dataset=eval_dataset, callbacks=callbacks,
            resume_from_checkpoint=resume_from_checkpoint, console_logs=console_logs, peft_config=peft_config,
            on_loaded=on_loaded,
        )  # fmt: skip
    finally:
        lock.release()


def _train_locked(
    args, model, processor, train_dataset, *, out: Path, main_process: bool, reward_funcs, run_info,
    eval_dataset, callbacks, resume_from_checkpoint, console_logs, peft_config=None, on_loaded=None,
):  # fmt: skip

    info = dict(run_info)
    if "provenance" not in info and "provenance_history" not in info:  # not ncgrpo train's (prepare_run's)
        resumed = resume_from_checkpoint is not None and main_process
        info.update(
            continue_provenance(
                read_run_json(out) if resumed else None, event="resume", where=out, warn=main_process,
                **({"checkpoint": Path(resume_from_checkpoint).name} if resumed else {}),
            )
        )  # fmt: skip
    loaded = _Loaded(out, info, main_process, on_loaded)
    if resume_from_checkpoint is None:
        loaded.write()
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
        callbacks=[loaded, *callbacks],  # the trainer's own MetricsCallback writes metrics.jsonl, first
        peft_config=peft_config,
    )
    trainer.nc_record_run = False  # run.json is this driver's: the recipe, the command's identity
    if not console_logs:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    try:
        if _at_max_steps(args, resume_from_checkpoint):
            _finish_from_checkpoint(trainer, resume_from_checkpoint, out, main_process)
            loaded.write()
        else:
            trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    except (RuntimeError, ValueError, KeyError) as e:
        if loaded.done or resume_from_checkpoint is None or isinstance(e, RolloutResumeError):
            raise
        raise ValueError(
            f"{resume_from_checkpoint} does not load into the model as now set up ({type(e).__name__}: "
            f"{_first_lines(e)}); {out}'s {RUN_FILE} and {CONFIG_FILE} are left as they were: resume with "
            "the run's own settings (a changed lora_r, use_peft, model or dtype cannot load its weights)"
        ) from e
    try:
        trainer.save_model(str(out))
        if main_process:
            processor.save_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - only a write that ran out of room is replaced
        error = disk_full_error(
            e,
            out,
            "run.json still says the run is not finished; free some space, then rerun with --resume "
            "(it continues from the last complete checkpoint)",
        )
        if error is None:
            raise
        raise error from e
    if main_process:
        write_train_run_json(out, info, finished=True, global_step=int(trainer.state.global_step))
    # README.md: the method as run, the base model, the paper (main process only); after `finished`, which
    # speaks of the model: a card that cannot be written must not make a complete run look cut short
    trainer.create_model_card()
    return trainer


class _Loaded(TrainerCallback):
    """Writes a run's ``run.json`` (and calls ``on_loaded``) once: at once for a new run, at
    ``on_train_begin`` for a resumed one (the Trainer has loaded the checkpoint's weights, optimizer,
    scheduler, trainer state and NC-GRPO's state by then)."""

    def __init__(self, out: Path, info: dict[str, Any], main_process: bool, on_loaded=None):
        self.out, self.info, self.main_process, self.on_loaded = out, info, main_process, on_loaded
        self.done = False

    def write(self) -> None:
        if self.done:
            return
        self.done = True
        if self.main_process:
            if self.on_loaded is not None:
                self.on_loaded()
            write_train_run_json(self.out, self.info, finished=False)

    def on_train_begin(self, args, state, control, **kwargs):
        self.write()


def _first_lines(e: BaseException, limit: int = 600) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _at_max_steps(args, checkpoint: str | None) -> bool:
    """Whether ``checkpoint`` (resumed from) already holds the run's last step: ``max_steps`` set and
    reached (:func:`ncgrpo.runs.folder.checkpoint_step`). The Trainer would train one step more."""

    if checkpoint is None or args.max_steps is None or args.max_steps <= 0:
        return False
    step = checkpoint_step(checkpoint)
    return step is not None and step >= args.max_steps


def _finish_from_checkpoint(trainer, checkpoint: str, out: Path, main_process: bool) -> None:
    """A run killed after its last checkpoint but before its final save: load that checkpoint's weights
    and trainer state, with no training step (``Trainer.train`` resumed at ``max_steps`` trains one step
    more, issue 35), so the final save writes the very weights an uninterrupted run would have; the
    metrics file is cut back to the checkpoint's step as a resumed run's is (:class:`MetricsCallback`)."""

    trainer._load_from_checkpoint(checkpoint)
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    if main_process:
        MetricsCallback(out / METRICS_FILE)._repair(trainer.state.global_step)


# ------------------------------------------------------------------------------------ execution
def reward_functions(names: Sequence[str]) -> list:
    """The reward functions ``names`` stand for: built-in names of :mod:`ncgrpo.rewards` or dotted
    import paths of one's own (:func:`ncgrpo.rewards.loading.resolve_reward`)."""

    return [resolve_reward(name) for name in names]


def load_model(model_args: ModelConfig) -> tuple[Any, Any]:
    """(model, processor or tokenizer) as ``model_args`` (``ModelArguments``) say, left where
    ``from_pretrained`` put it (the Trainer places it). With ``use_peft`` a local folder is loaded by its absolute path, so
    the adapter saved at the end names a base model (``adapter_config.json``'s ``base_model_name_or_path``)
    that loads from any working directory."""

    m = model_args
    path = m.model_name_or_path
    if m.use_peft and os.path.isdir(path):
        path = os.path.abspath(path)
    return models.load_model_and_processor(
        path,
        dtype=m.dtype,
        device=None,
        attn_implementation=m.attn_implementation,
        min_pixels=m.min_pixels,
        max_pixels=m.max_pixels,
        freeze_vision=m.freeze_vision_tower,
    )


def _lora_config(model_args: ModelConfig) -> Any:
    """``trl.get_peft_config(model_args)``, with one fix: TRL's ``ModelConfig`` turns a one-item
    ``lora_target_modules`` into a string, which peft reads as a regex matched against whole module names,
    so ``--lora_target_modules q_proj`` targeted nothing (peft: "No modules were targeted"). A single
    plain module name (letters, digits, ``_``) is kept as the one-name list the user gave; ``all-linear``
    and patterns (``.*\\.q_proj``) stay as they are."""

    config = get_peft_config(model_args)
    target = config.target_modules
    if isinstance(target, str) and target != "all-linear" and re.fullmatch(r"[A-Za-z_]\w*", target):
        config.target_modules = {target}
    return config


def _check_lora_targets(config: Any, model_type: str | None) -> None:
    """A model type peft has no default LoRA target modules for (the Qwen-VL family) needs
    ``lora_target_modules``: said with the flag's name, from the model's config alone (``--dry-run`` too)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    if config.target_modules is None and not config.target_parameters and model_type not in DEFAULT_TARGETS:
        raise ValueError(
            f"use_peft: peft has no default LoRA target modules for model type {model_type!r}; set "
            "lora_target_modules (e.g. --lora_target_modules all-linear, or q_proj k_proj v_proj o_proj)"
        )


def peft_config_for(model_args: ModelConfig, model: Any) -> Any:
    """The ``peft.LoraConfig`` of ``use_peft`` (None without it), made by ``trl.get_peft_config`` as TRL's
    scripts make it. Two ncgrpo additions: with ``freeze_vision_tower`` the vision tower is excluded
    (``exclude_modules``), so the adapter trains the language model only, as the full-weight run does
    (Qwen2.5-VL's vision blocks have ``gate_proj``/``up_proj``/``down_proj`` too); and a model type peft
    has no default target modules for (the Qwen-VL family) is an error naming ``--lora_target_modules``
    here, before the trainer starts, instead of peft's."""
    if not model_args.use_peft:
        return None

    config = _lora_config(model_args)
    _check_lora_targets(config, getattr(model.config, "model_type", None))
    tower = find_vision_tower(model) if model_args.freeze_vision_tower else None
    if tower is not None:
        config.exclude_modules = rf"{re.escape(tower[0])}(\..*)?"
    return config


def execute_run(plan: RunPlan):
    """Load the model (vision tower frozen if asked) and train the plan through
    :func:`train_run` (with ``use_peft``: a LoRA adapter, :func:`peft_config_for`; the
    folder then holds the adapter, not full weights); the run folder's lock is released at the end. A
    write that runs out of room (a full disk, a file-size limit) is a
    :class:`~ncgrpo.runs.folder.DiskFullError` naming the folder and its free space."""
    if plan.dry_run:
        raise ValueError("a dry-run plan is not trained; prepare it with dry_run=False")
    try:
        model, processor = load_model(plan.model_args)
        peft_config = peft_config_for(plan.model_args, model)  # refusals before anything is written
        plan.write_folder()  # nothing is written before the model has loaded
        return train_run(
            plan.training_args,
            model,
            processor,
            plan.train_dataset,
            reward_funcs=reward_functions(plan.script_args.reward_funcs),
            run_info=plan.run_info,
            eval_dataset=plan.eval_dataset,
            resume_from_checkpoint=plan.checkpoint,
            peft_config=peft_config,
            on_loaded=plan.write_settings if plan.resuming else None,
        )
    except Exception as e:  # noqa: BLE001 - only a write that ran out of room is replaced
        # metrics.jsonl, run.json, config.yaml: anything the run writes (checkpoints and the final save
        # say so themselves, naming their own folder)
        error = None if isinstance(e, DiskFullError) else disk_full_error(
            e, plan.output_dir, "free some space, then rerun with --resume (it continues from the last "
            "complete checkpoint)"
        )  # fmt: skip
        if error is None:
            raise
        raise error from e
    finally:
        plan.release()
