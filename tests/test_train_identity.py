"""Issue 35: a training run's identity is every setting that changes what is computed (TRL's and
transformers' fields included, a short documented list excepted), held in run.json as well as
config.yaml; ``--resume`` with any of it changed is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import test_train_cli
from ncgrpo.cli import main
from test_train_cli import MODEL, _args, _fake_complete_checkpoint, _tiny_run

geo3k, tiny_vl = test_train_cli.geo3k, test_train_cli.tiny_vl  # fixtures


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("flag", "before", "after", "shown"),
    [
        ("--max_grad_norm", "1.0", "0.5", "max_grad_norm: 1.0 -> 0.5"),
        ("--num_iterations", "1", "2", "num_iterations: 1 -> 2"),
        ("--top_k", "0", "5", "top_k: 0 -> 5"),
        ("--weight_decay", "0.0", "0.1", "weight_decay: 0.0 -> 0.1"),
        ("--reward_weights", "1.0", "2.0", "reward_weights: [1.0] -> [2.0]"),
    ],
)
def test_resume_refuses_a_changed_trl_setting(
    tmp_path: Path, geo3k: Path, capsys, flag: str, before: str, after: str, shown: str
) -> None:
    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run", flag, before)) == 0
    _fake_complete_checkpoint(out / "checkpoint-1")
    files = _snapshot(out)
    capsys.readouterr()
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", flag, after)) == 2
    err = capsys.readouterr().err
    assert "ncgrpo train: error: --resume of" in err and shown in err, err
    assert "another --output_dir" in err and "--overwrite" in err
    assert _snapshot(out) == files  # refused before anything is written
    # the same value given explicitly, or left at its default, is the same run
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", flag, before)) == 0


def test_the_identity_is_held_in_run_json_so_a_lost_config_yaml_does_not_switch_it_off(
    tmp_path: Path, geo3k: Path, capsys
) -> None:
    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--sigma0", "0.2")) == 0
    identity = json.loads((out / "run.json").read_text())["identity"]
    assert identity["sigma0"] == 0.2 and identity["weight_decay"] == 0.0 and "logging_steps" not in identity
    _fake_complete_checkpoint(out / "checkpoint-1")
    (out / "config.yaml").unlink()
    files = _snapshot(out)
    capsys.readouterr()
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", "--sigma0", "0.9")) == 2
    err = capsys.readouterr().err
    assert "sigma0: 0.2 -> 0.9" in err and "run.json" in err, err
    assert _snapshot(out) == files


def test_force_records_what_changed_in_run_json(tmp_path: Path, geo3k: Path, capsys) -> None:
    from ncgrpo.commands.parser import ConfigParser
    from ncgrpo.commands.train_prepare import prepare_run
    from ncgrpo.commands.train_settings import train_dataclasses

    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run")) == 0
    _fake_complete_checkpoint(out / "checkpoint-1")
    argv = _args(out, geo3k, MODEL, "--max_grad_norm", "0.5")[1:]
    plan = prepare_run(
        ConfigParser(train_dataclasses).parse_args(argv).parsed_config, resume=True, force=True
    )
    plan.release()
    assert plan.run_info["forced_changes"] == ["max_grad_norm: 1.0 -> 0.5"]
    assert plan.run_info["identity"]["max_grad_norm"] == 0.5


def test_what_may_change_on_resume_is_short_and_documented() -> None:
    from ncgrpo.commands.train_settings import run_identity_keys
    from ncgrpo.runs.identity import MAY_CHANGE_REASONS

    keys = set(run_identity_keys())
    for name in ("max_grad_norm", "num_iterations", "top_k", "weight_decay", "reward_weights", "optim",
                 "adam_beta1", "warmup_steps", "lr_scheduler_kwargs", "gradient_accumulation_steps",
                 "per_device_train_batch_size", "steps_per_generation", "lora_r", "attn_implementation"):  # fmt: skip
        assert name in keys, name
    assert not keys & set(MAY_CHANGE_REASONS)
    docs = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    for name in MAY_CHANGE_REASONS:
        assert f"`{name}`" in docs, f"docs/cli.md does not list {name}, which may change on resume"


# ------------------------------------------------------------------------------ --overwrite (case 5)
def test_overwrite_with_resume_is_a_usage_error(tmp_path: Path, geo3k: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--resume", "--overwrite")) == 2
    err = capsys.readouterr().err
    assert "ncgrpo train: error: --overwrite and --resume: pick one" in err
    assert not out.exists()


def test_overwrite_starts_a_finished_run_with_checkpoints_again_and_removes_only_its_files(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, capsys
) -> None:
    out = tmp_path / "run"
    common = ("--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1")
    assert main(_tiny_run(out, geo3k, tiny_vl, *common)) == 0
    assert (out / "checkpoint-2").is_dir() and json.loads((out / "run.json").read_text())["finished"]
    (out / "notes.txt").write_text("mine")  # not a training run's file: kept
    capsys.readouterr()
    assert (
        main(_tiny_run(out, geo3k, tiny_vl, "--max_steps", "1", "--save_strategy", "no", "--overwrite")) == 0
    )
    err = capsys.readouterr().err
    assert "--overwrite: removed checkpoint-1, checkpoint-2, metrics.jsonl, model.safetensors" in err, err
    assert not list(out.glob("checkpoint-*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1]  # the old run's lines are gone
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 1 and "overwriting" not in run
    assert run["identity"]["max_steps"] == 1
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_clear_train_outputs_never_touches_another_kind(tmp_path: Path) -> None:
    from ncgrpo.runs.folder import FolderKindError, clear_train_outputs

    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "run.json").write_text(json.dumps({"kind": "eval"}))
    (ev / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FolderKindError):
        clear_train_outputs(ev)
    assert (ev / "metrics.jsonl").exists()


def test_an_overwrite_cut_short_is_not_resumed(tmp_path: Path, geo3k: Path, capsys) -> None:
    out = tmp_path / "run"
    _fake_complete_checkpoint(out / "checkpoint-1")
    (out / "run.json").write_text(json.dumps({"kind": "train", "finished": False, "overwriting": True}))
    assert main(_args(out, geo3k, MODEL, "--resume")) == 2
    assert "an --overwrite was cut short" in capsys.readouterr().err


def test_overwrite_with_another_seed_generates_the_synthetic_suite_for_that_seed(tmp_path: Path) -> None:
    from test_train_cli import TINY_RECIPE

    out = tmp_path / "run"
    small = ["--max_steps", "1", "--max_completion_length", "4", "--num_generations", "2",
             "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"]  # fmt: skip
    base = ["train", "--config", str(TINY_RECIPE), "--output_dir", str(out), *small]
    suite = out / "synthetic-data" / "data" / "train-00000-of-00001.parquet"
    assert main([*base, "--seed", "0"]) == 0
    first = suite.read_bytes()
    assert main([*base, "--seed", "1", "--overwrite"]) == 0
    assert suite.read_bytes() != first  # not the suite generated for the old run's seed
    assert main([*base, "--seed", "0", "--overwrite"]) == 0
    assert suite.read_bytes() == first
