"""Issue 35, ``ncgrpo train``'s crash recovery, end to end on the tiny model (CPU): a run interrupted
after its last checkpoint but before its final save, and a checkpoint write that hits a full disk,
each end with the very weights of an uninterrupted run (constant learning rate, so a step too many
or too few shows)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

import test_train_cli
from ncgrpo.cli import main
from test_train_cli import _tiny_run

geo3k, tiny_vl = test_train_cli.geo3k, test_train_cli.tiny_vl  # fixtures

COMMON = (
    "--rollout_method", "latent", "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1",
    "--lr_scheduler_type", "constant", "--learning_rate", "1e-3",
)  # fmt: skip


def _loss_steps(out: Path) -> list[int]:
    return [
        r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, geo3k: Path, tiny_vl: Path) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 0
    assert _loss_steps(out) == [1, 2, 3]
    return out


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa), "the resumed run ended in other weights"


def test_a_run_killed_before_its_final_save_resumes_to_the_same_weights_with_no_extra_step(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, reference: Path, monkeypatch
) -> None:
    from ncgrpo.trainer import NCGRPOTrainer

    out = tmp_path / "run"
    save = NCGRPOTrainer.save_model

    def killed_at_the_final_save(self, output_dir=None, *a, **k):
        if output_dir is not None and Path(output_dir) == out:
            raise KeyboardInterrupt  # the kill lands after checkpoint-3, before the final weights
        return save(self, output_dir, *a, **k)

    monkeypatch.setattr(NCGRPOTrainer, "save_model", killed_at_the_final_save)
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 130
    monkeypatch.setattr(NCGRPOTrainer, "save_model", save)
    assert (out / "checkpoint-3").is_dir() and not (out / "model.safetensors").exists()
    assert not json.loads((out / "run.json").read_text())["finished"]

    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON, "--resume")) == 0
    assert _loss_steps(out) == [1, 2, 3]
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 3, run
    _same_weights(out, reference)


# --------------------------------------------------------------- torn checkpoint files (case 3)
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory, geo3k: Path, tiny_vl: Path) -> Path:
    out = tmp_path_factory.mktemp("two") / "run"
    args = ("--rollout_method", "latent", "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1")
    assert main(_tiny_run(out, geo3k, tiny_vl, *args)) == 0
    return out


def _tear(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "name",
    [
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "model.safetensors",
        "ncgrpo_state.pt",
        "rollout_batch.pt",
    ],
)
def test_a_torn_file_in_the_newest_checkpoint_makes_resume_fall_back_to_the_one_before(
    tmp_path: Path, two_checkpoints: Path, name: str
) -> None:
    from ncgrpo.runs.folder import checkpoint_problem, last_complete_checkpoint

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    assert last_complete_checkpoint(out, nc_state=True)[0] == str(out / "checkpoint-2")
    assert (out / "checkpoint-2" / name).is_file()
    _tear(out / "checkpoint-2" / name)
    assert name in (checkpoint_problem(out / "checkpoint-2", nc_state=True) or "")
    ckpt, skipped = last_complete_checkpoint(out, nc_state=True)
    assert ckpt == str(out / "checkpoint-1")
    assert len(skipped) == 1 and skipped[0].startswith("checkpoint-2:") and name in skipped[0]


def test_a_flipped_byte_in_the_optimizer_state_is_caught_by_its_crc(
    tmp_path: Path, two_checkpoints: Path
) -> None:
    from ncgrpo.runs.folder import checkpoint_problem

    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(two_checkpoints / "checkpoint-2", ckpt)
    path = ckpt / "optimizer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "optimizer.pt" in (checkpoint_problem(ckpt) or "")


def test_resume_past_a_torn_optimizer_finishes_with_the_same_weights(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, reference: Path, monkeypatch, capsys
) -> None:
    """A kill while checkpoint-3's optimizer.pt was written (trainer_state.json written by hand after
    it, as a file system that reorders writes could leave it): --resume says it skips checkpoint-3 and
    ends with the uninterrupted run's weights."""
    from ncgrpo.trainer import NCGRPOTrainer

    out = tmp_path / "run"
    save = NCGRPOTrainer.save_model

    def killed_at_the_final_save(self, output_dir=None, *a, **k):
        if output_dir is not None and Path(output_dir) == out:
            raise KeyboardInterrupt
        return save(self, output_dir, *a, **k)

    monkeypatch.setattr(NCGRPOTrainer, "save_model", killed_at_the_final_save)
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 130
    monkeypatch.setattr(NCGRPOTrainer, "save_model", save)
    _tear(out / "checkpoint-3" / "optimizer.pt")
    capsys.readouterr()
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON, "--resume")) == 0
    err = capsys.readouterr().err
    assert "skipping incomplete checkpoint-3" in err and "optimizer.pt" in err
    assert "resuming from checkpoint-2" in err
    assert _loss_steps(out) == [1, 2, 3]
    _same_weights(out, reference)


# ------------------------------------------------------------------------ a full disk (case 4)
@pytest.mark.parametrize(
    "raised",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EFBIG, "File too large"),
        RuntimeError(
            "[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/3: "
            "file write failed"
        ),
    ],
    ids=["ENOSPC", "EFBIG", "pytorch-writer"],
)
def test_a_full_disk_while_a_checkpoint_is_written_is_a_clear_error_and_resume_loses_nothing(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, reference: Path, monkeypatch, capsys, raised
) -> None:
    import torch

    out = tmp_path / "run"
    save = torch.save

    def full_at_checkpoint_2(obj, f, *a, **k):
        if str(f).endswith(str(Path("checkpoint-2") / "optimizer.pt")):
            raise raised
        return save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_at_checkpoint_2)
    capsys.readouterr()
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 2
    monkeypatch.setattr(torch, "save", save)
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert f"ncgrpo train: error: {out / 'checkpoint-2'}: writing it failed for lack of room" in err, err
    assert "GiB free on its file system" in err and "--resume" in err
    assert not (out / "checkpoint-2").exists()  # the checkpoint cut short was removed
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()

    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON, "--resume")) == 0
    assert _loss_steps(out) == [1, 2, 3]
    _same_weights(out, reference)


def test_a_full_disk_at_the_final_save_is_a_clear_error_and_resume_finishes(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, reference: Path, monkeypatch, capsys
) -> None:
    from ncgrpo.trainer import NCGRPOTrainer

    out = tmp_path / "run"
    save = NCGRPOTrainer.save_model

    def full_at_the_final_save(self, output_dir=None, *a, **k):
        if output_dir is not None and Path(output_dir) == out:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, output_dir, *a, **k)

    monkeypatch.setattr(NCGRPOTrainer, "save_model", full_at_the_final_save)
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 2
    monkeypatch.setattr(NCGRPOTrainer, "save_model", save)
    err = capsys.readouterr().err
    assert f"ncgrpo train: error: {out}: writing it failed for lack of room" in err, err
    assert not json.loads((out / "run.json").read_text())["finished"]
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON, "--resume")) == 0
    assert _loss_steps(out) == [1, 2, 3]
    _same_weights(out, reference)


def test_a_full_disk_while_metrics_are_appended_is_a_clear_error(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, monkeypatch, capsys
) -> None:
    from ncgrpo.driver import MetricsCallback

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(MetricsCallback, "on_log", full)
    out = tmp_path / "run"
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 2
    err = capsys.readouterr().err
    assert f"ncgrpo train: error: {out}: writing it failed for lack of room" in err, err
    assert "GiB free on its file system" in err
