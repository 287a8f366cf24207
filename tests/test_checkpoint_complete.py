"""What makes a checkpoint complete (:func:`ncgrpo.runs.folder.checkpoint_problem`) beyond whole files
(issue 43): the keys a resume reads from ``trainer_state.json`` and an adapter whose tensors are finite.
A checkpoint that fails either is skipped for the one before, as a torn one is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ncgrpo.runs.folder import TRAINER_STATE_KEYS, checkpoint_problem, last_complete_checkpoint

STATE = {"global_step": 1, "max_steps": 2, "train_batch_size": 2, "epoch": 0.5, "log_history": []}


def _checkpoint(folder: Path, state=STATE, adapter=None) -> Path:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps(state))
    if adapter is None:
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    else:
        save_file(adapter, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text("{}")
    return folder


def test_a_whole_checkpoint_is_complete(tmp_path: Path) -> None:
    assert checkpoint_problem(_checkpoint(tmp_path / "checkpoint-1")) is None
    adapter = {"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.zeros(3, 2)}
    assert checkpoint_problem(_checkpoint(tmp_path / "checkpoint-2", adapter=adapter)) is None


@pytest.mark.parametrize(
    "state, said",
    [
        ({}, "lacks global_step"),
        ([], "holds no JSON object"),
        ({**STATE, "train_batch_size": None}, "train_batch_size None"),
        ({k: v for k, v in STATE.items() if k != "log_history"}, "lacks log_history"),
        ({**STATE, "global_step": "1"}, "global_step '1'"),
        ({**STATE, "global_step": -1}, "below 0"),
        ({**STATE, "global_step": True}, "global_step True"),
    ],
)
def test_a_trainer_state_without_what_resume_reads_is_incomplete(tmp_path: Path, state, said) -> None:
    """``{}`` used to count as complete: the resume then died in transformers with "TypeError:
    unsupported operand type(s) for //" instead of falling back to the checkpoint before."""
    out = tmp_path / "run"
    _checkpoint(out / "checkpoint-1")
    _checkpoint(out / "checkpoint-2", state=state)
    problem = checkpoint_problem(out / "checkpoint-2") or ""
    assert "trainer_state.json" in problem and said in problem, problem
    ckpt, skipped = last_complete_checkpoint(out)
    assert ckpt == str(out / "checkpoint-1") and skipped[0].startswith("checkpoint-2:")


def test_the_keys_checked_are_the_ones_trainer_writes(tmp_path: Path) -> None:
    from transformers import TrainerState

    state = TrainerState(global_step=3, max_steps=4, train_batch_size=2, epoch=1.0)
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    written = json.loads((tmp_path / "trainer_state.json").read_text())
    assert set(TRAINER_STATE_KEYS) <= set(written)
    _checkpoint(tmp_path / "checkpoint-3", state=written)
    assert checkpoint_problem(tmp_path / "checkpoint-3") is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_values_is_incomplete(tmp_path: Path, bad: float) -> None:
    """A NaN-filled adapter used to resume, and the noise hook then blamed the model's dtype."""
    out = tmp_path / "run"
    good = {"a.lora_A.weight": torch.ones(2, 3), "a.lora_B.weight": torch.zeros(3, 2)}
    _checkpoint(out / "checkpoint-1", adapter=good)
    broken = {**good, "a.lora_B.weight": torch.full((3, 2), bad)}
    _checkpoint(out / "checkpoint-2", adapter=broken)
    problem = checkpoint_problem(out / "checkpoint-2") or ""
    assert "non-finite" in problem and "a.lora_B.weight" in problem, problem
    assert last_complete_checkpoint(out)[0] == str(out / "checkpoint-1")
