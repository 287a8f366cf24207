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

from ncgrpo.cli import main
from test_train_cli import _tiny_run, geo3k, tiny_vl  # noqa: F401 - fixtures

COMMON = (
    "--rollout_method", "latent", "--max_steps", "3", "--save_strategy", "steps", "--save_steps", "1",
    "--lr_scheduler_type", "constant", "--learning_rate", "1e-3",
)  # fmt: skip


def _loss_steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, geo3k: Path, tiny_vl: Path) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_tiny_run(out, geo3k, tiny_vl, *COMMON)) == 0
    assert _loss_steps(out) == [1, 2, 3]
    return out


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all((wa[k] == wb[k]).all() for k in wa), "the resumed run ended in other weights"


def test_a_run_killed_before_its_final_save_resumes_to_the_same_weights_with_no_extra_step(
    tmp_path: Path, geo3k: Path, tiny_vl: Path, reference: Path, monkeypatch  # noqa: F811
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
    assert run["finished"] and run["global_step"] == 3
    _same_weights(out, reference)
