"""``ncgrpo train``'s preparation: everything before the model (:func:`prepare_run`), with the checks
that need no weights (:func:`check_model_source`, the model's config, the data against one generation
batch, what the trainer's constructor would refuse)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl.import_utils import is_vllm_available

from ncgrpo.commands.config_file import suggest
from ncgrpo.commands.train_settings import (
    DATA_HASH_KEY,
    ModelArguments,
    ScriptArguments,
    recorded_identity,
    run_identity,
)
from ncgrpo.commands.train_smoke import apply_smoke, command_line_keys, config_file_values, resolve_derived
from ncgrpo.rewards.loading import check_reward_signature, resolve_reward
from ncgrpo.runs.folder import (
    CONFIG_FILE,
    RUN_FILE,
    FolderLock,
    changed_identity,
    checkpoint_step,
    folder_kind,
    last_complete_checkpoint,
    read_run_json,
)
from ncgrpo.runs.provenance import continue_provenance

if TYPE_CHECKING:  # the driver imports transformers: ncgrpo --help imports every command module
    from ncgrpo.driver import RunPlan

__all__ = ["check_model_source", "check_report_to", "prepare_run"]


# --------------------------------------------------------------------- checks before the model
def check_model_source(name: str) -> None:
    """:func:`ncgrpo.models.check_model_source` for ``ncgrpo train``'s setting ``model_name_or_path``."""
    from ncgrpo.models import check_model_source as check

    check(name, "model_name_or_path")


def _model_config(name: str):
    """The model's config (no weights): the first thing ``from_pretrained`` reads."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - any reason it does not load is the user's to see, named
        where = "folder" if Path(name).is_dir() else "hub id (not a local folder)"
        raise ValueError(f"model_name_or_path {name}: its config does not load as a {where}: {e}") from None


#: ``report_to`` integrations: the transformers availability check's name and the install command
#: (transformers' ``INTEGRATION_TO_CALLBACK``; its callback raises only once the model has loaded).
_REPORTERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("is_tensorboard_available", "pip install tensorboard"),
    "wandb": ("is_wandb_available", "pip install wandb"),
    "trackio": ("is_trackio_available", "pip install trackio"),
    "mlflow": ("is_mlflow_available", "pip install mlflow"),
    "comet_ml": ("is_comet_available", "pip install comet_ml"),
    "neptune": ("is_neptune_available", "pip install neptune"),
    "clearml": ("is_clearml_available", "pip install clearml"),
    "codecarbon": ("is_codecarbon_available", "pip install codecarbon"),
    "azure_ml": ("is_azureml_available", "pip install azureml-core"),
    "dagshub": ("is_dagshub_available", "pip install dagshub mlflow"),
    "dvclive": ("is_dvclive_available", "pip install dvclive"),
    "swanlab": ("is_swanlab_available", "pip install swanlab"),
    "flyte": ("is_flytekit_available", "pip install flytekit flytekitplugins-deck-standard"),
    "kubeflow": ("is_kubeflow_available", "pip install kubeflow"),
}


def check_report_to(report_to) -> None:
    """Every ``report_to`` integration's package is installed (``none`` and ``all``, which transformers
    resolves to the installed ones, need nothing): a missing one is an error naming the install
    command, before the model loads (transformers' callback raises only then) and in a dry run."""
    from transformers.integrations import integration_utils

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in _REPORTERS:  # transformers refuses it only once the model has loaded
            raise ValueError(
                f"report_to {name!r} is not an integration transformers knows{suggest(name, _REPORTERS)}; use "
                f"one of none, all, {', '.join(_REPORTERS)}"
            )
        check, install = _REPORTERS[name]
        available = getattr(integration_utils, check, None)
        if available is not None and not available():
            raise ValueError(
                f"report_to {name}: the {name} package is not installed here: {install} (or --report_to none)"
            )


def _check_before_the_model(
    plan_args, model_args: ModelArguments, train_dataset, script_args=None, eval_dataset: Any = ...
) -> None:
    """Checks that need no weights, the ones the trainer would otherwise make after the model loads:
    the model's config (its source is checked first, by the caller: :func:`check_model_source`), the
    noise site against its layers (:func:`ncgrpo.models.check_noise_site`), the
    dataset against one generation batch (TRL would otherwise train 0 steps and save the base weights),
    and what ``GRPOTrainer.__init__`` / ``NCGRPOTrainer.__init__`` refuse before they generate (vLLM
    installed for ``use_vllm``, one weight per reward, continuous batching with a processor,
    ``share_prompt_loss`` against the model and attention, several GPUs in one process)."""
    from ncgrpo.driver import _check_lora_targets, _lora_config
    from ncgrpo.methods import get_method
    from ncgrpo.models import check_noise_site

    a = plan_args
    name = model_args.model_name_or_path
    config = _model_config(name)  # the caller checked the source (check_model_source) before the data
    method = get_method(a.rollout_method)
    if method.hidden_noise:
        check_noise_site(a.noise_site, name, config)
    per_generation = a.per_device_train_batch_size * a.world_size * a.steps_per_generation
    prompts_needed = per_generation // a.num_generations
    if len(train_dataset) < prompts_needed:
        raise ValueError(
            f"the training set has {len(train_dataset)} prompts but one generation batch takes "
            f"{prompts_needed} (per_device_train_batch_size {a.per_device_train_batch_size} x "
            f"{a.world_size} processes x steps_per_generation {a.steps_per_generation} / num_generations "
            f"{a.num_generations}); use more data or a smaller batch"
        )
    if eval_dataset is None and str(getattr(a.eval_strategy, "value", a.eval_strategy)) != "no":
        raise ValueError(
            f"eval_strategy {getattr(a.eval_strategy, 'value', a.eval_strategy)} evaluates during training, "
            "but no evaluation split is set: name one with --eval_dataset_splits (e.g. validation), or set "
            "--eval_strategy no"
        )
    if model_args.use_peft:
        _check_lora_targets(_lora_config(model_args), config.model_type)
        if a.use_vllm and method.two_pass:
            raise ValueError(
                f"use_peft with use_vllm and rollout_method={a.rollout_method!r}: NCGRPOTrainer refuses an "
                "NC-GRPO method on vLLM with an adapter (TRL's merged-adapter sync is untested with the noise); "
                "set --use_vllm false (the noise acts through the adapter there)"
            )
    if a.use_vllm:
        if not is_vllm_available():
            raise ValueError(
                "use_vllm=true, but vLLM is not installed here: pip install -e '.[vllm]' (a GPU wheel), "
                "or --use_vllm false for the transformers engine"
            )
    if script_args is not None:  # each reward takes TRL's call with this data's columns as keywords
        columns = [c for c in train_dataset.column_names if c != "prompt"]
        for reward in script_args.reward_funcs:
            check_reward_signature(resolve_reward(reward), reward, columns)
    if script_args is not None and a.reward_weights is not None:
        if len(a.reward_weights) != len(script_args.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(a.reward_weights)} weights but reward_funcs names "
                f"{len(script_args.reward_funcs)} functions ({', '.join(script_args.reward_funcs)})"
            )
    from ncgrpo.models import is_vision_language

    if a.use_transformers_continuous_batching and is_vision_language(config):
        raise ValueError(
            "use_transformers_continuous_batching does not support vision-language models (TRL); set it false"
        )
    if a.share_prompt_loss:
        from ncgrpo.trainer.shared_loss import SUPPORTED_ATTENTION, SUPPORTED_MODEL_TYPES

        attn = model_args.attn_implementation or "sdpa"
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"share_prompt_loss=True: {name}'s model_type {config.model_type!r} is not one it is tested on "
                f"({', '.join(SUPPORTED_MODEL_TYPES)}); set share_prompt_loss=False."
            )
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"share_prompt_loss=True needs a 4-D attention mask, which attn_implementation={attn!r} does "
                "not take; use sdpa (or eager), or set share_prompt_loss=False."
            )
    if a.n_gpu > 1:
        raise ValueError(
            f"{a.n_gpu} GPUs are visible to one process, which the trainer refuses (nn.DataParallel); launch "
            "with accelerate launch (recipes/accelerate/) or make one GPU visible with CUDA_VISIBLE_DEVICES"
        )


def _refuse_foreign_files(output_dir: Path) -> None:
    """A folder no ncgrpo command wrote (:func:`~ncgrpo.runs.folder.folder_kind` None) that holds files is
    refused: the run would write its model card (README.md), weights, tokenizer and processor files over
    any of the same name."""

    if not output_dir.is_dir() or folder_kind(output_dir) is not None:
        return
    # hidden names (the lock, a suite copy or an atomic write cut short) and the generated suite are a
    # run's own leftovers, and no file a run writes is hidden
    found = sorted(
        p.name for p in output_dir.iterdir() if not p.name.startswith(".") and p.name != "synthetic-data"
    )
    if found:
        shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
        raise ValueError(
            f"{output_dir} holds files no ncgrpo run wrote ({shown}); a run writes its model card (README.md), "
            "weights and tokenizer files there, over any of the same name: pass a new or empty --output_dir"
        )


def _trainer_config(parsed):
    """``NCGRPOConfig`` from the parsed settings, as the real run builds it (in a dry run too)."""
    from ncgrpo.trainer import NCGRPOConfig

    where = parsed.config or "the command line"
    try:
        return parsed.build(NCGRPOConfig)
    except (TypeError, ValueError, NotImplementedError) as e:
        hint = ""
        if "bf16" in str(e) or "fp16" in str(e):
            hint = (
                " (a recipe for GPUs on a machine without one: --smoke tries it small on the CPU; "
                "--bf16 false --use_cpu true runs it as is)"
            )
        raise ValueError(f"{where}: trainer settings rejected by NCGRPOConfig: {e}{hint}") from None


def _needs_generated_suite(script_args: ScriptArguments) -> bool:
    s = script_args
    return (s.dataset_name == "synthetic" and s.dataset_path is None) or (
        bool(s.eval_dataset_splits) and s.eval_name == "synthetic" and s.eval_path is None
    )


def _check_identity(output_dir: Path, parsed, force: bool) -> list[str]:
    """Compare the run's recorded identity (:func:`~ncgrpo.commands.train_settings.recorded_identity`)
    with this command's; a difference is refused naming each setting and both values unless ``force``.
    Returns the differences (``[]``: none, or nothing recorded)."""
    old, where = recorded_identity(output_dir)
    if old is None:
        # run.json's identity and config.yaml both gone: nothing to compare with, so nothing is
        # assumed (a resume with changed settings would pass unseen)
        if force:
            return ["identity unknown: run.json's identity and config.yaml were missing"]
        raise ValueError(
            f"--resume of {output_dir}: neither {RUN_FILE} (with its identity) nor {CONFIG_FILE} is there, so "
            "the settings given now cannot be compared with the run's; restore one of them from a copy, or "
            "pass --force to resume with the settings given now (recorded in run.json's forced_changes)"
        )
    new = run_identity(parsed)
    # a record without the data file's hash (config.yaml alone) compares the settings only
    changed = changed_identity(old, new, [k for k in new if k != DATA_HASH_KEY or k in old])
    if changed and not force:
        raise ValueError(
            f"--resume of {output_dir} with settings that change the run (as recorded in {where} -> as given "
            f"now): {'; '.join(changed)}. Resume with the run's own settings; or train into another "
            "--output_dir; or pass --overwrite instead of --resume to start this run again from scratch "
            "(--force resumes anyway, recording the change in run.json's forced_changes)"
        )
    return changed


def _provenance_keys(output_dir: Path, previous, checkpoint: str | None, dry_run: bool) -> dict[str, Any]:
    """run.json's ``provenance`` (what made the run: :mod:`ncgrpo.runs.provenance`) and, for a resume
    from ``checkpoint``, its ``provenance_history``: a resume under another commit, other package
    versions or uncommitted source is a ``ProvenanceWarning`` (the main process; a dry run warns as the
    resume would) and a history entry; a run started over gets this process's alone."""

    if checkpoint is None:
        return continue_provenance(None, event="start", where=output_dir)
    return continue_provenance(
        previous,
        event="resume",
        where=output_dir,
        warn=os.environ.get("RANK", "0") == "0",
        recorded=not dry_run,
        checkpoint=Path(checkpoint).name,
    )


def prepare_run(
    parsed,
    *,
    resume: bool = False,
    dry_run: bool = False,
    force: bool = False,
    overwrite: bool = False,
    smoke: bool = False,
    synthetic: Callable[[Path, int], Any] | None = None,
) -> RunPlan:
    """Everything before the model: from a :class:`ncgrpo.commands.config_file.ParsedConfig` of
    :func:`ncgrpo.commands.train_settings.train_dataclasses` to a :class:`ncgrpo.driver.RunPlan`.
    Nothing is written into the run folder here but by a dry run once every check has passed; a real
    run writes it in :func:`ncgrpo.driver.execute_run`, once the model has loaded
    (:meth:`ncgrpo.driver.RunPlan.write_folder`).

    ``smoke``: the recipe shrunk to a CPU minute (:func:`ncgrpo.commands.train_smoke.apply_smoke`).
    Then settings derived from others follow their overrides
    (:func:`~ncgrpo.commands.train_smoke.resolve_derived`). ``run_name`` defaults to the config file's
    stem and ``output_dir`` to ``runs/<run_name>``; both are recorded in the resolved config. Refused,
    each in a dry run too:

    - a folder another process is writing (its lock, :class:`ncgrpo.runs.folder.FolderLock`, names the
      holder), a file, or a folder of another kind (an evaluation, a demo's root, a saved model:
      :func:`ncgrpo.runs.folder.folder_kind`);
    - ``resume`` with ``overwrite`` (pick one);
    - a folder of files no ncgrpo run wrote (the run's model card, weights and tokenizer would go over
      them);
    - a folder whose ``run.json`` says the run finished, unless ``overwrite``; ``overwrite``
      starts the run again there: once the folder's lock is held, its checkpoints, metrics and final
      weights are removed (:meth:`ncgrpo.driver.RunPlan.write_folder`);
    - a folder holding ``checkpoint-*`` without ``resume`` or ``overwrite`` (a dry run refuses each of
      these as the run does, issue 43);
    - ``resume`` with settings that change the run (:func:`~ncgrpo.commands.train_settings.run_identity`,
      compared with the one ``run.json`` records, a setting it lacks with ``config.yaml``'s) unless
      ``force``; with neither file there, ``resume`` is refused unless ``force``;
    - trainer settings ``NCGRPOConfig`` rejects (TRL's batch arithmetic, bf16 without a GPU, ...);
    - the checks of :func:`_check_before_the_model`: a model path that is not there (at once, no hub
      lookup), a config that does not load, a noise site past the model's layers, a training set
      smaller than one generation batch, what the trainer's constructor refuses (an ``eval_strategy``
      without an evaluation split), a ``report_to`` integration that is not installed.

    ``resume`` continues from the newest COMPLETE checkpoint
    (:func:`ncgrpo.runs.folder.last_complete_checkpoint`); newer incomplete ones are named in the notes.
    A synthetic suite the run generates (``dataset_name synthetic``, no path) is built in a temporary
    folder and moved to ``OUTPUT/synthetic-data`` when the folder is written.
    """

    from accelerate import PartialState

    from ncgrpo.driver import RunPlan, _folder_state, build_datasets

    notes: list[str] = []
    given = command_line_keys(parsed)
    file_values = config_file_values(parsed)
    overridden = set(given)
    if smoke:
        smoke_notes, applied = apply_smoke(parsed, given)
        notes += smoke_notes
        overridden |= applied
    notes += resolve_derived(parsed, overridden, file_values)
    script_args = parsed.build(ScriptArguments)
    model_args = parsed.build(ModelArguments)
    name = parsed.get("run_name") or (Path(parsed.config).stem if parsed.config else "ncgrpo")
    if "/" in name or "\\" in name or name in (".", "..") or not name.strip():
        raise ValueError(
            f"run_name {name!r} is not a name: it becomes the folder runs/<run_name>, so it may hold no path "
            "separator and may not be '.' or '..' (to write elsewhere, set --output_dir)"
        )
    output_dir = Path(parsed.get("output_dir") or Path("runs") / name)
    parsed.set("run_name", name)
    parsed.set("output_dir", str(output_dir))
    method, seed = str(parsed.get("rollout_method")), int(parsed.get("seed"))
    lock = FolderLock(output_dir, "ncgrpo train", kind="train")
    if os.environ.get("RANK", "0") == "0":  # the main process (PartialState is made below, once configured)
        lock.check()  # a file, another kind, another writer: refused before any other check reads it
        _refuse_foreign_files(output_dir)

    if overwrite and resume:
        raise ValueError(
            f"--overwrite and --resume: pick one: --resume continues the run in {output_dir} from its newest "
            "complete checkpoint; --overwrite starts it again from scratch there (removing its checkpoints, "
            "metrics and final weights)"
        )
    seen = _folder_state(output_dir)  # what the checks below read; write_folder compares it under the lock
    any_checkpoint = sorted(output_dir.glob("checkpoint-*")) if output_dir.is_dir() else []
    previous = read_run_json(output_dir, hint="move it away or fix it")
    if previous is not None and previous.get("overwriting") and not overwrite:
        raise ValueError(
            f"{output_dir}: an --overwrite was cut short while it removed the old run's files; pass "
            "--overwrite again (or use another --output_dir)"
        )
    if previous is not None and previous.get("finished") and not overwrite:
        raise ValueError(
            f"{output_dir} holds a finished run ({previous.get('name')!r}, {previous.get('global_step')} steps); "
            "use another --output_dir, or --overwrite to train it again from scratch"
        )
    # a dry run refuses what the real command would (it used to pass a finished run's folder)
    if any_checkpoint and not resume and not overwrite:
        raise ValueError(
            f"{output_dir} already holds {any_checkpoint[-1].name}; pass --resume to continue that run, "
            "--overwrite to start it again from scratch, or another --output_dir"
        )
    checkpoint = None
    forced_changes = list((previous or {}).get("forced_changes") or []) if resume else []
    if resume:
        from ncgrpo.methods import get_method

        checkpoint, skipped = last_complete_checkpoint(output_dir, nc_state=get_method(method).two_pass)
        notes += [f"skipping incomplete {s}" for s in skipped]
        if checkpoint is None:
            notes.append(f"no complete checkpoint in {output_dir}; starting from scratch")
            forced_changes = []  # the run starts over: nothing before it was trained under other settings
        if checkpoint is not None:
            notes.append(f"resuming from {Path(checkpoint).name}, the newest complete checkpoint")
            max_steps, step = parsed.get("max_steps"), checkpoint_step(checkpoint)
            if isinstance(max_steps, int) and 0 < max_steps <= (step or 0):
                notes.append(
                    f"{Path(checkpoint).name} holds the run's last step (max_steps {max_steps}): no step is "
                    "trained; its weights are saved as the final model"
                )
            forced = _check_identity(output_dir, parsed, force)
            if forced:
                notes.append("resuming with changed settings (--force): " + "; ".join(forced))
                forced_changes = [*((previous or {}).get("forced_changes") or []), *forced]

    training_args = _trainer_config(parsed)
    check_report_to(training_args.report_to)  # before the data: a missing package costs no suite
    # initialise the distributed state with the config's settings (backend, timeout) before the
    # PartialState below shares it
    _ = training_args.device
    state = PartialState()
    run_info = {
        "kind": "train",
        "name": name,
        "method": method,
        "seed": seed,
        "model": model_args.model_name_or_path,
        "recipe": parsed.config,
        "output_dir": str(output_dir),
        # the run's identity here as well as in config.yaml: one lost file does not switch the check off
        "identity": run_identity(parsed),
    }
    if forced_changes:
        run_info["forced_changes"] = forced_changes  # --force: the steps before and after differ in these
    # what made the run (commit, package versions): a resume under others warns and is recorded, not refused
    run_info.update(_provenance_keys(output_dir, previous, checkpoint, dry_run))
    # a dry run leaves a folder that already holds a run as it found it (its config.yaml and run.json
    # say what that run was, finished or not); into a new folder it writes the resolved config
    keep = dry_run and (previous is not None or bool(any_checkpoint))
    staging = None
    data_dir = output_dir
    fresh_suite = overwrite and not dry_run  # the old run's suite was generated for its own seed
    if _needs_generated_suite(script_args) and (
        fresh_suite or not (output_dir / "synthetic-data" / "data").is_dir()
    ):
        staging = Path(tempfile.mkdtemp(prefix="ncgrpo-train-data-"))
        data_dir = staging
    try:
        check_model_source(model_args.model_name_or_path)  # before the data: a typo costs no suite
        train_ds, eval_ds = build_datasets(script_args, data_dir, seed=seed, synthetic=synthetic)
        _check_before_the_model(training_args, model_args, train_ds, script_args, eval_ds)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if keep:
        notes.append(
            f"dry run: {output_dir} holds a run; its {CONFIG_FILE} and {RUN_FILE} are left as they are"
        )
    plan = RunPlan(
        name=name,
        method=method,
        seed=seed,
        output_dir=output_dir,
        checkpoint=checkpoint,
        script_args=script_args,
        model_args=model_args,
        training_args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        run_info=run_info,
        notes=notes,
        main_process=state.is_main_process,
        lock=lock,
        config_text=parsed.to_yaml(),
        staging=staging,
        dry_run=dry_run,
        keep=keep,
        seen=seen,
        overwrite=overwrite and not dry_run,
    )
    if dry_run:
        try:
            plan.write_folder()
        finally:
            plan.release()
    return plan
