"""Resume: a run stopped after step 1 and resumed from its checkpoint draws the same noise (keys,
sigma_k) at steps 2-3 as an uninterrupted run, and SPSA's steering vector mu is restored."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from ncgrpo.runs.folder import STATE_FILE

_spec = importlib.util.spec_from_file_location(
    "tiny_grpo", Path(__file__).parent / "scripts" / "tiny_grpo.py"
)
tiny = importlib.util.module_from_spec(_spec)
sys.modules["tiny_grpo"] = tiny
_spec.loader.exec_module(tiny)

RUN = dict(
    rollout_method="spsa",
    max_steps=3,
    sigma_schedule="sigmoid",
    schedule_gamma=4.0,
    schedule_k_mid=2.0,
    spsa_lr=5.0,
    spsa_mu_max=100.0,
)


class StopAfter(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


@pytest.mark.slow
def test_resume_draws_the_same_noise_and_restores_mu(tmp_path) -> None:
    full = tiny.trainer(tmp_path / "full", **RUN)
    full.train()
    assert [r.step for r in full.nc_history] == [1, 2, 3]

    part = tiny.trainer(tmp_path / "part", save_strategy="steps", save_steps=1, **RUN)
    part.add_callback(StopAfter(1))
    part.train()
    assert [r.step for r in part.nc_history] == [1]
    ckpt = tmp_path / "part" / "checkpoint-1"
    saved = torch.load(ckpt / STATE_FILE, weights_only=True)
    assert torch.equal(saved["spsa_mu"], part.nc_state.mu)
    assert float(saved["spsa_mu"].norm()) > 0  # the step-1 update moved mu (else the test proves little)

    resumed = tiny.trainer(tmp_path / "part", save_strategy="steps", save_steps=1, **RUN)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert [r.step for r in resumed.nc_history] == [2, 3]
    for a, b in zip(full.nc_history[1:], resumed.nc_history, strict=True):
        assert a.step == b.step and a.total_steps == b.total_steps == 3
        assert a.sigma_k == b.sigma_k
        assert a.rows == b.rows  # the same rows, flags and NoiseKeys
        assert a.method_values["mu_norm"] == pytest.approx(
            b.method_values["mu_norm"], rel=1e-6
        )  # mu restored (generation at step 2 uses it)
        assert a.rewards == b.rewards  # weights and RNG restored too: the very same rollouts
    assert full.nc_history[1].method_values["mu_norm"] == pytest.approx(
        float(saved["spsa_mu"].norm()), rel=1e-6
    )
    pf, pr = dict(full.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(pf[k], pr[k]) for k in pf)
    sig = [r.sigma_k for r in full.nc_history]
    assert sig[0] > sig[1] > sig[2] > 0  # the schedule actually moved


def test_resume_restores_renamed_vl_weights(tmp_path) -> None:
    """Qwen2.5-VL checkpoints are saved under legacy key names; resuming must still load every weight
    (transformers 5.23's Trainer alone restores none of them)."""
    tr = tiny.trainer(tmp_path / "a", rollout_method="latent")
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(1.0)
    tr.model.save_pretrained(tmp_path / "ckpt")
    fresh = tiny.trainer(tmp_path / "b", rollout_method="latent")
    from ncgrpo.trainer.checkpoints import renamed_checkpoint_keys

    assert renamed_checkpoint_keys(fresh.model)  # the case the override exists for
    fresh._load_from_checkpoint(str(tmp_path / "ckpt"))
    want = dict(tr.model.named_parameters())
    assert all(torch.equal(p, want[k]) for k, p in fresh.model.named_parameters())


def test_missing_state_file_is_an_error(tmp_path) -> None:
    tr = tiny.trainer(tmp_path, rollout_method="spsa")
    with pytest.raises(FileNotFoundError, match="steering vector"):
        tr._load_optimizer_and_scheduler(str(tmp_path))


def test_only_complete_checkpoints_are_resumed_from(tmp_path) -> None:
    """A checkpoint cut short (torn trainer state, missing NC-GRPO state) is skipped for the newest
    complete one; with save_total_limit=1 the complete one survives until its successor is complete."""
    import shutil

    from ncgrpo.runs.folder import checkpoint_problem, last_complete_checkpoint

    out = tmp_path / "run"
    tr = tiny.trainer(out, save_strategy="steps", save_steps=1, save_total_limit=1, **{**RUN, "max_steps": 2})
    tr.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2", nc_state=True) is None
    assert last_complete_checkpoint(out, nc_state=True) == (str(out / "checkpoint-2"), [])

    torn = out / "checkpoint-3"
    shutil.copytree(out / "checkpoint-2", torn)
    state = (torn / "trainer_state.json").read_bytes()
    (torn / "trainer_state.json").write_bytes(state[: len(state) // 2])  # a kill mid-write
    best, skipped = last_complete_checkpoint(out, nc_state=True)
    assert best == str(out / "checkpoint-2") and "checkpoint-3" in skipped[0] and "torn" in skipped[0]

    (torn / "trainer_state.json").write_bytes(state)
    (torn / STATE_FILE).unlink()
    assert "ncgrpo_state.pt" in checkpoint_problem(torn, nc_state=True)
    assert checkpoint_problem(torn, nc_state=False) is None  # vanilla runs keep no NC-GRPO state
    assert last_complete_checkpoint(tmp_path / "nothing") == (None, [])


def test_nc_state_is_written_before_the_checkpoint_counts_as_complete(tmp_path, monkeypatch) -> None:
    """ncgrpo_state.pt and rollout_batch.pt are in the folder before transformers writes
    trainer_state.json (and rotates)."""
    from trl import GRPOTrainer

    seen = []

    def fake_save(self, model, trial):
        ckpt = tmp_path / "run" / f"checkpoint-{self.state.global_step}"
        seen.append(
            (
                (ckpt / STATE_FILE).exists(),
                (ckpt / "rollout_batch.pt").exists(),
                (ckpt / "trainer_state.json").exists(),
            )
        )

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", fake_save)
    tr = tiny.trainer(
        tmp_path / "run", rollout_method="spsa", max_steps=1, save_strategy="steps", save_steps=1
    )
    tr.train()
    assert seen == [(True, True, False)]
