"""Issue 43: ``ncgrpo train`` interrupted with a real SIGINT (Ctrl-C) right after a checkpoint INSIDE a
rollout batch (``steps_per_generation`` > ``gradient_accumulation_steps``, ``num_iterations`` > 1) and
resumed with ``--resume`` ends exactly where the uninterrupted run ends: every weight tensor, every logged
metric (timings aside), the sigma_k sequence, the RNG state and the rollout batch in flight of the last
checkpoint are bit-equal, and generation happens at the same steps.

Before the fix a checkpoint held no rollout batch: the resumed run generated anew at its first step (from
weights and a sigma_k of another step) and then at the wrong offsets (steps 1, 3, 7 instead of 1, 5),
and 39 of the embedded base's 69 weight tensors ended different, silently.

The runs train the embedded base on its synthetic suite (``recipes/tiny_cpu_latent.yaml``; it gets mixed
rewards, so the weights move: a model whose rewards are all equal would pass any resume test) with 4
optimizer steps per rollout batch. The fast tests interrupt ONE run at each offset in turn (after
checkpoint 1, its resume after checkpoint 2, that resume after checkpoint 3), so each resume starts inside
the batch that an earlier resume restored and saved again; the slow one interrupts a fresh run at each
offset. Interrupts are placed by the run's observed progress (the checkpoint's trainer_state.json), never
by wall time."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tiny_models import same_state

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu_latent.yaml"
BASE = ROOT / "src" / "ncgrpo" / "toy" / "assets" / "base"
STEPS = 6  # the first rollout batch is steps 1-4, the second generates at step 5
UPDATES = 4  # optimizer steps per rollout batch in both variants

#: the sigmoid schedule, 4 rollout-batch slices of one micro-batch each: generation at steps 1 and 5
SIGMOID = ("--steps_per_generation", "4", "--gradient_accumulation_steps", "1")
#: the target schedule (sigma_k solved at each generation from the weights), 2 micro-batches per optimizer
#: step, 2 passes over each rollout batch (4 x 2 / 2 = 4 updates per batch), a log line every 2 steps (so a
#: checkpoint at an odd step holds metrics TRL has gathered but not logged)
TARGET = (
    "--target_marginal_tv", "0.005", "--sigma_schedule", "constant", "--steps_per_generation", "4",
    "--gradient_accumulation_steps", "2", "--num_iterations", "2", "--logging_steps", "2",
)  # fmt: skip
#: TRL's own GRPO (no NC-GRPO state file): the rollout batch is TRL's, kept all the same
VANILLA = ("--rollout_method", "vanilla", "--steps_per_generation", "4", "--gradient_accumulation_steps", "1")
#: wall-clock fields of a log line: never equal between two runs
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _cmd(out: Path, variant: tuple[str, ...]) -> list[str]:
    return [
        sys.executable, "-m", "ncgrpo", "train", "--config", str(TINY_RECIPE), "--output_dir", str(out),
        "--model_name_or_path", str(BASE), "--num_generations", "4", "--per_device_train_batch_size", "4",
        "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", "1", "--resume", *variant,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_to_end(out: Path, variant: tuple[str, ...]) -> None:
    r = subprocess.run(_cmd(out, variant), env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]


def _checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def _interrupt_after_checkpoint(out: Path, variant: tuple[str, ...], step: int) -> None:
    """Start (or resume) the run and send it a real SIGINT as soon as ``checkpoint-step`` is complete;
    the next resume must start there, so a later checkpoint the run completed before the signal landed
    (the run is not paused) is removed, as if the signal had landed a moment earlier."""
    from ncgrpo.runs.folder import checkpoint_problem, last_complete_checkpoint

    target = out / f"checkpoint-{step}"

    def complete() -> bool:  # whole, not only begun: a signal inside its write leaves it cut short
        return (target / "trainer_state.json").is_file() and checkpoint_problem(
            target, nc_state=variant is not VANILLA
        ) is None

    p = subprocess.Popen(
        _cmd(out, variant), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 600
        while p.poll() is None and not complete():
            assert time.monotonic() < deadline, f"checkpoint-{step} not written in 10 minutes"
            time.sleep(0.005)
        assert p.poll() is None, (
            f"the run ended before checkpoint-{step} could be interrupted: "
            + (p.stderr.read().decode()[-3000:])
        )
        os.kill(p.pid, signal.SIGINT)
        err = p.communicate(timeout=600)[1].decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "ncgrpo train: interrupted" in err, err[-3000:]
    for later in _checkpoints(out):
        if later > step:
            shutil.rmtree(out / f"checkpoint-{later}")
    ckpt, _ = last_complete_checkpoint(out, nc_state=variant is not VANILLA)  # vanilla: no ncgrpo_state.pt
    assert ckpt is not None and Path(ckpt).name == f"checkpoint-{step}"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _step_rows(out: Path) -> list[dict]:
    """The per-step log lines (not the closing summary, which describes the last ``train()`` call), less
    their wall-clock fields."""
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in _rows(out) if "train_runtime" not in r]


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _check_same_as_uninterrupted(out: Path, ref: Path) -> None:
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} weight tensors differ from the uninterrupted run's"
    assert _generation_steps(out) == _generation_steps(ref)  # rollouts generated at the same steps
    assert _step_rows(out) == _step_rows(ref)  # every logged metric (loss, reward, sigma_k, ...), bit for bit
    last = f"checkpoint-{STEPS}"
    # the RNG state (python, numpy, torch) and the rollout state of the last checkpoint
    assert same_state(_load(out / last / "rng_state.pth"), _load(ref / last / "rng_state.pth"))
    assert same_state(_load(out / last / "rollout_batch.pt"), _load(ref / last / "rollout_batch.pt"))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """The uninterrupted runs, one per variant, made on first use."""
    made: dict[tuple[str, ...], Path] = {}

    class Refs(dict):
        def __missing__(self, variant):
            ref = tmp_path_factory.mktemp("ref") / "run"
            _run_to_end(ref, variant)
            made[variant] = ref
            return ref

    return Refs()


def _generation_steps(out: Path) -> list[int]:
    return [r["step"] for r in _step_rows(out) if "reward" in r]


def test_sigint_at_every_offset_of_a_rollout_batch_resumes_exactly_sigmoid(
    tmp_path: Path, references
) -> None:
    ref = references[SIGMOID]
    assert _generation_steps(ref) == [1, 5]
    sigmas = [r["noise/sigma_k"] for r in _step_rows(ref) if "noise/sigma_k" in r]
    assert len(sigmas) == 2 and sigmas[1] < sigmas[0]  # annealed between the two rollout batches
    out = tmp_path / "run"
    for step in range(1, UPDATES):  # checkpoints 1, 2, 3: each offset inside the first rollout batch
        _interrupt_after_checkpoint(out, SIGMOID, step)
    _run_to_end(out, SIGMOID)
    _check_same_as_uninterrupted(out, ref)


def test_sigint_at_every_offset_resumes_exactly_target_schedule_two_iterations(
    tmp_path: Path, references
) -> None:
    """The target schedule with num_iterations 2 and 2 micro-batches per step: the rollout batch is reused
    for a second pass, and a checkpoint at an odd step holds metrics not logged yet (logging_steps 2)."""
    ref = references[TARGET]
    sigmas = [r["noise/sigma_k"] for r in _step_rows(ref) if "noise/sigma_k" in r]
    assert len(sigmas) == 2 and sigmas[0] != sigmas[1]  # solved anew for the second rollout batch
    out = tmp_path / "run"
    for step in range(1, UPDATES):
        _interrupt_after_checkpoint(out, TARGET, step)
    _run_to_end(out, TARGET)
    _check_same_as_uninterrupted(out, ref)


def test_a_checkpoint_inside_a_rollout_batch_without_its_batch_is_refused(tmp_path: Path, references) -> None:
    """A checkpoint written inside a rollout batch by an ncgrpo that did not keep the batch (no
    rollout_batch.pt) cannot resume exactly: refused (exit 2) naming it, before any step is trained."""
    out = tmp_path / "run"
    _interrupt_after_checkpoint(out, SIGMOID, 2)
    (out / "checkpoint-2" / "rollout_batch.pt").unlink()
    before = (out / "metrics.jsonl").read_bytes()
    r = subprocess.run(_cmd(out, SIGMOID), env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (
        "ncgrpo train: error: resume: " in r.stderr
        and "checkpoint-2 was saved at optimizer step 2, " in r.stderr
    )
    assert "inside a rollout batch" in r.stderr and "no rollout_batch.pt" in r.stderr
    assert "Traceback" not in r.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    assert _checkpoints(out) == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [SIGMOID, TARGET, VANILLA], ids=["sigmoid", "target", "vanilla"])
@pytest.mark.parametrize("step", range(1, UPDATES + 1))
def test_sigint_after_each_checkpoint_of_a_fresh_run_resumes_exactly(
    tmp_path: Path, references, variant: tuple[str, ...], step: int
) -> None:
    """One fresh run per offset (1-3 inside the first rollout batch, 4 at its end), interrupted once."""
    out = tmp_path / "run"
    _interrupt_after_checkpoint(out, variant, step)
    _run_to_end(out, variant)
    _check_same_as_uninterrupted(out, references[variant])


# ------------------------------------------------------------- save_rollout_batch / load_rollout_batch alone
def _fake_trainer(step: int, global_step: int, *, spg=4, ga=1, iterations=1, processes=1, rank=0):
    """The attributes of a GRPOTrainer that the rollout checkpoint reads and writes."""
    from collections import defaultdict
    from types import SimpleNamespace

    return SimpleNamespace(
        args=SimpleNamespace(steps_per_generation=spg, gradient_accumulation_steps=ga),
        num_iterations=iterations,
        accelerator=SimpleNamespace(num_processes=processes, process_index=rank, device=torch.device("cpu")),
        state=SimpleNamespace(global_step=global_step),
        _step=step,
        _buffered_inputs=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _tr_loss=torch.tensor(0.0),
        _globalstep_last_logged=global_step,
    )


def _batch(i: int) -> dict:
    return {
        "prompt_ids": torch.arange(6, dtype=torch.long).reshape(2, 3) + i,
        "advantages": torch.tensor([0.5, -0.5], dtype=torch.float64) * i,
        "pixel_values": torch.full((4, 3), float(i), dtype=torch.bfloat16),
        "num_items_in_batch": torch.tensor(7),
        "num_images": [1, 1],
        "ref_per_token_logps": None,
    }


def test_rollout_batch_round_trip_restores_the_batch_step_metrics_and_pending_loss(tmp_path: Path) -> None:
    from ncgrpo.trainer.checkpoints import load_rollout_batch, restore_pending_loss, save_rollout_batch

    saved = _fake_trainer(step=2, global_step=2)
    saved._buffered_inputs = [_batch(i) for i in range(4)]
    saved._metrics["train"]["reward"].append(0.25)
    saved._tr_loss = torch.tensor(-0.125)
    saved._globalstep_last_logged = 1
    save_rollout_batch(saved, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_batch.pt"]  # no temporary file left

    resumed = _fake_trainer(step=0, global_step=2)
    load_rollout_batch(resumed, str(tmp_path))
    assert resumed._step == 2
    assert same_state(resumed._buffered_inputs, saved._buffered_inputs)  # values, dtypes, None and lists
    assert [b["pixel_values"].dtype for b in resumed._buffered_inputs] == [torch.bfloat16] * 4
    assert dict(resumed._metrics["train"]) == {"reward": [0.25]}
    resumed._metrics["train"]["loss"].append(1.0)  # still a defaultdict, as TRL's
    restore_pending_loss(resumed)  # the first micro-step after the resume
    assert resumed._tr_loss.item() == -0.125 and resumed._globalstep_last_logged == 1


def test_rollout_batch_refusals_name_the_checkpoint_and_why(tmp_path: Path) -> None:
    from ncgrpo.trainer.checkpoints import load_rollout_batch, rollout_file, save_rollout_batch

    # inside a batch with no rollout_batch.pt (an older checkpoint): refused; at a boundary: TRL generates
    with pytest.raises(
        ValueError, match=r"saved at optimizer step 3, inside a rollout batch \(micro-step 3 of "
    ):
        load_rollout_batch(_fake_trainer(0, 3), str(tmp_path))
    boundary = _fake_trainer(0, 4)
    load_rollout_batch(boundary, str(tmp_path))
    assert boundary._step == 0 and boundary._buffered_inputs is None

    saved = _fake_trainer(step=6, global_step=3, ga=2, iterations=2)
    saved._buffered_inputs = [_batch(i) for i in range(4)]
    save_rollout_batch(saved, str(tmp_path))
    # another batch layout (a forced resume): the batch cannot be continued
    with pytest.raises(ValueError, match=r"under another batch layout \(num_iterations 2 -> 1\)"):
        load_rollout_batch(_fake_trainer(0, 3, ga=2, iterations=1), str(tmp_path))
    # the file of another step
    with pytest.raises(ValueError, match="of optimizer step 3, not 2"):
        load_rollout_batch(_fake_trainer(0, 2, ga=2, iterations=2), str(tmp_path))
    # TRL's micro-step disagrees with where the Trainer resumes its data
    odd = _fake_trainer(step=5, global_step=3, ga=2, iterations=2)
    odd._buffered_inputs = saved._buffered_inputs
    save_rollout_batch(odd, str(tmp_path))
    with pytest.raises(
        ValueError, match="saved at TRL micro-step 5, while the Trainer resumes its data at micro-step 6"
    ):
        load_rollout_batch(_fake_trainer(0, 3, ga=2, iterations=2), str(tmp_path))
    # one file per process, named as transformers names its RNG state files
    assert rollout_file(tmp_path, 1, 2) == str(tmp_path / "rollout_batch_1.pt")


@pytest.mark.slow
def test_two_processes_interrupted_inside_a_rollout_batch_resume_exactly(tmp_path: Path) -> None:
    """Two CPU processes (torchrun + gloo), each with its own share of the rollout batch
    (``rollout_batch_0.pt``, ``rollout_batch_1.pt``): SIGINT to the process group after checkpoint 2,
    resume, and the weights, log lines, and each rank's RNG and rollout state match the uninterrupted
    two-process run."""
    from tiny_models import free_port

    def cmd(out: Path) -> list[str]:
        one = _cmd(out, SIGMOID)
        one[one.index("--per_device_train_batch_size") + 1] = "2"  # 2 processes x 2 rows = one process's 4
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
        return [*torchrun, "--master_port", str(free_port()), *one[one.index("-m") :]]

    ref = tmp_path / "ref"
    r = subprocess.run(cmd(ref), env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    p = subprocess.Popen(
        cmd(out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while p.poll() is None and not (out / "checkpoint-2" / "trainer_state.json").is_file():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert p.poll() is None
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches every process of the terminal's group
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for later in _checkpoints(out):
        if later > 2:
            shutil.rmtree(out / f"checkpoint-{later}")
    assert {"rollout_batch_0.pt", "rollout_batch_1.pt"} <= {f.name for f in (out / "checkpoint-2").iterdir()}
    r = subprocess.run(cmd(out), env=_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _step_rows(out) == _step_rows(ref) and _generation_steps(out) == [1, 5]
    for name in ("rng_state_0.pth", "rng_state_1.pth", "rollout_batch_0.pt", "rollout_batch_1.pt"):
        assert same_state(
            _load(out / f"checkpoint-{STEPS}" / name), _load(ref / f"checkpoint-{STEPS}" / name)
        )
