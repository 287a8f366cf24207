"""Every optional package a setting needs is checked at ``--dry-run`` and before anything is written,
naming the install command (issue 43: ``--report_to tensorboard`` passed the dry run, then failed after
the model loaded with "internal error: RuntimeError: TensorBoardCallback requires tensorboard")."""

from __future__ import annotations

from pathlib import Path

import pytest

from ncgrpo.cli import main
from test_train_cli import MODEL, _args, write_geo3k_parquet


@pytest.fixture(scope="module")
def geo3k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_geo3k_parquet(tmp_path_factory.mktemp("geo3k"))


@pytest.mark.parametrize(
    "name, check, install",
    [
        ("tensorboard", "is_tensorboard_available", "pip install tensorboard"),
        ("wandb", "is_wandb_available", "pip install wandb"),
        ("mlflow", "is_mlflow_available", "pip install mlflow"),
    ],
)
@pytest.mark.parametrize("dry", [True, False])
def test_a_report_to_integration_that_is_not_installed_is_refused_before_anything_is_written(
    tmp_path: Path, geo3k: Path, monkeypatch, capsys, name, check, install, dry
) -> None:
    from transformers.integrations import integration_utils

    monkeypatch.setattr(integration_utils, check, lambda: False)
    out = tmp_path / "run"
    flags = ["--report_to", name] + (["--dry-run"] if dry else [])
    assert main(_args(out, geo3k, MODEL, *flags)) == 2
    err = capsys.readouterr().err
    assert f"ncgrpo train: error: report_to {name}" in err and install in err, err
    assert not out.exists()


def test_report_to_none_and_an_installed_integration_pass(tmp_path: Path, geo3k: Path, monkeypatch) -> None:
    from transformers.integrations import integration_utils

    from ncgrpo.commands.train_prepare import check_report_to

    check_report_to(["none"])
    check_report_to("all")  # transformers resolves it to the installed ones
    monkeypatch.setattr(integration_utils, "is_tensorboard_available", lambda: True)
    check_report_to(["tensorboard"])
    assert main(_args(tmp_path / "run", geo3k, MODEL, "--report_to", "none", "--dry-run")) == 0


def test_an_unknown_report_to_name_is_refused_in_the_dry_run(tmp_path: Path, geo3k: Path, capsys) -> None:
    """transformers refuses it only once the model has loaded."""
    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--report_to", "tensorbord", "--dry-run")) == 2
    err = capsys.readouterr().err
    assert "report_to 'tensorbord' is not an integration" in err and "did you mean 'tensorboard'" in err, err
    assert not out.exists()


def test_an_eval_strategy_without_an_evaluation_split_is_refused_before_the_model(
    tmp_path: Path, geo3k: Path, capsys
) -> None:
    """The Trainer refused it after the model had loaded and run.json/config.yaml were written."""
    out = tmp_path / "run"
    for dry in (["--dry-run"], []):
        assert main(_args(out, geo3k, MODEL, "--eval_strategy", "steps", "--eval_steps", "1", *dry)) == 2
        err = capsys.readouterr().err
        assert "no evaluation split is set" in err and "--eval_dataset_splits" in err, err
        assert not out.exists()
