"""``ncgrpo train --resume`` and the run's recorded identity (issue 43): a forced resume that does not
load leaves the run's own settings recorded; the identity is read from run.json, a setting it lacks from
config.yaml; with both gone the resume is refused (unless --force); a dry run refuses the folders the
real command refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from ncgrpo.cli import main
from test_train_cli import MODEL, _args, _fake_complete_checkpoint, write_geo3k_parquet


@pytest.fixture(scope="module")
def geo3k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_geo3k_parquet(tmp_path_factory.mktemp("geo3k"))


def _run_with_checkpoint(out: Path, geo3k: Path, *flags: str) -> None:
    """A dry run's run.json and config.yaml plus a complete checkpoint-1: a run that can be resumed."""
    assert main(_args(out, geo3k, MODEL, "--dry-run", *flags)) == 0
    _fake_complete_checkpoint(out / "checkpoint-1")


def test_resume_with_run_json_and_config_yaml_both_gone_is_refused_unless_forced(
    tmp_path: Path, geo3k: Path, capsys
) -> None:
    """It used to accept any changed setting (nothing left to compare with)."""
    out = tmp_path / "run"
    _run_with_checkpoint(out, geo3k, "--learning_rate", "1e-5")
    (out / "run.json").unlink()
    (out / "config.yaml").unlink()
    capsys.readouterr()
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", "--learning_rate", "3e-4")) == 2
    err = capsys.readouterr().err
    assert "run.json" in err and "config.yaml" in err and "cannot be compared" in err and "--force" in err
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", "--learning_rate", "3e-4", "--force")) == 0
    assert "identity unknown" in capsys.readouterr().err


def test_a_setting_missing_from_run_json_is_compared_with_config_yaml_not_its_default(
    tmp_path: Path, geo3k: Path, capsys
) -> None:
    out = tmp_path / "run"
    _run_with_checkpoint(out, geo3k, "--sigma0", "0.7")
    run = json.loads((out / "run.json").read_text())
    del run["identity"]["sigma0"]  # an older run.json, or one edited by hand
    (out / "run.json").write_text(json.dumps(run))
    assert yaml.safe_load((out / "config.yaml").read_text())["sigma0"] == 0.7
    capsys.readouterr()
    # the run's own value resumes; the default (0.2 in the recipe) is a change
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume", "--sigma0", "0.7")) == 0
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--resume")) == 2
    err = capsys.readouterr().err
    assert "sigma0: 0.7 -> 0.2" in err and "config.yaml" in err


@pytest.mark.parametrize(
    "state, flags, said",
    [
        ({"finished": True, "global_step": 2}, (), "holds a finished run"),
        ({"finished": False, "overwriting": True}, (), "--overwrite was cut short"),
        ({}, ("checkpoint",), "already holds checkpoint-1"),
    ],
)
def test_a_dry_run_refuses_a_folder_the_run_refuses(tmp_path: Path, geo3k: Path, capsys, state, flags, said):
    """--dry-run used to pass a finished run's folder, which the real command refuses."""
    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run")) == 0
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, **state}))
    if "checkpoint" in flags:
        _fake_complete_checkpoint(out / "checkpoint-1")
    before = {f: (out / f).read_bytes() for f in ("run.json", "config.yaml")}
    capsys.readouterr()
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--seed", "8")) == 2
    assert said in capsys.readouterr().err
    assert {f: (out / f).read_bytes() for f in before} == before
    # --overwrite is what the real command takes there; its dry run leaves the files as they are
    assert main(_args(out, geo3k, MODEL, "--dry-run", "--seed", "8", "--overwrite")) == 0
    assert {f: (out / f).read_bytes() for f in before} == before


# ----------------------------------------------------------- a forced resume that does not load (real runs)
SMOKE = [
    "train",
    "--config",
    str(Path(__file__).resolve().parents[1] / "recipes" / "qwen2_5_vl_3b_latent_sigma0.2.yaml"),
    "--smoke",
    "--use_peft",
    "--lora_target_modules",
    "q_proj",
    "v_proj",
    "--max_steps",
    "2",
    "--save_steps",
    "1",
    "--num_generations",
    "4",
]


@pytest.mark.slow
def test_a_forced_resume_that_fails_to_load_leaves_run_json_and_config_yaml_as_they_were(
    tmp_path: Path, capsys
) -> None:
    """``--resume --force`` with a changed lora_r (a state-dict size mismatch) or without --use_peft used
    to rewrite run.json (lora_r 8, forced_changes) and config.yaml before the checkpoint failed to load,
    so the run's real settings were refused afterwards."""
    out = tmp_path / "run"
    assert main([*SMOKE, "--output_dir", str(out)]) == 0
    # as if killed after checkpoint-1: no final save, run.json not finished
    shutil.rmtree(out / "checkpoint-2")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (out / name).unlink()
    run = json.loads((out / "run.json").read_text())
    run.pop("global_step")
    (out / "run.json").write_text(json.dumps({**run, "finished": False}))
    before = {f: (out / f).read_bytes() for f in ("run.json", "config.yaml")}
    capsys.readouterr()

    for change in (["--lora_r", "8"], ["--use_peft", "false"]):
        rc = main([*SMOKE, "--output_dir", str(out), "--resume", "--force", *change])
        err = capsys.readouterr().err
        assert rc == 2, err[-2000:]
        assert "does not load into the model" in err and "left as they were" in err, err[-2000:]
        assert {f: (out / f).read_bytes() for f in before} == before, change
        assert not (out / "checkpoint-2").exists()

    # the run's own settings still resume, to the end
    assert main([*SMOKE, "--output_dir", str(out), "--resume"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 2 and "forced_changes" not in run
    assert run["identity"]["lora_r"] == 16


@pytest.mark.slow
def test_a_forced_resume_that_loads_records_its_changes(tmp_path: Path, capsys) -> None:
    """The files are still rewritten, with forced_changes, once the checkpoint has loaded."""
    out = tmp_path / "run"
    assert main([*SMOKE, "--output_dir", str(out), "--max_steps", "1"]) == 0
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "finished": False}))
    rc = main([*SMOKE, "--output_dir", str(out), "--max_steps", "2", "--resume", "--force"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 2
    assert any(c.startswith("max_steps: 1 -> 2") for c in run["forced_changes"]), run["forced_changes"]
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 2


def test_a_finished_run_with_checkpoints_says_finished_not_pass_resume(tmp_path: Path, geo3k: Path, capsys):
    """It said "already holds checkpoint-1; pass --resume", and --resume then said the run finished."""
    out = tmp_path / "run"
    _run_with_checkpoint(out, geo3k)
    run = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**run, "finished": True, "global_step": 1}))
    capsys.readouterr()
    for flags in ([], ["--dry-run"]):
        assert main(_args(out, geo3k, MODEL, *flags)) == 2
        err = capsys.readouterr().err
        assert "holds a finished run" in err and "pass --resume" not in err, err


def test_a_folder_of_other_files_is_refused(tmp_path: Path, geo3k: Path, capsys) -> None:
    """A run wrote its model card over a README.md it found there (the folder had no kind)."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    for flags in ([], ["--dry-run"]):
        assert main(_args(out, geo3k, MODEL, *flags)) == 2
        err = capsys.readouterr().err
        assert "holds files no ncgrpo run wrote (README.md)" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md"]
    assert (out / "README.md").read_text() == "my notes"
