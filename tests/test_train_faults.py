"""``ncgrpo train`` killed at random points (real SIGKILL, real subprocesses) and resumed with
``--resume`` until it finishes: the final weights equal an uninterrupted run's, and every step is
logged once. A fast variant (2 kills) runs by default; the 20-kill one is marked slow.

Kill points are placed by the run's observed progress (a step's log line, a checkpoint's
trainer_state.json) plus a seeded delay, never by wall time measured on another run: an earlier
version timed kills from an uninterrupted reference run and flaked when that run was loaded and the
killed one was not ("no kill landed before the run finished")."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from test_train_cli import TINY_RECIPE, write_geo3k_parquet

STEPS = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from tiny_models import save_tiny_vl

    model = save_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))
    return model, write_geo3k_parquet(tmp_path_factory.mktemp("geo3k"))


#: the method of the killed runs: SPSA (its mu is restored from the checkpoint)
SPSA = ("--rollout_method", "spsa", "--sigma0", "1.0", "--spsa_lr", "5.0")
#: the target schedule: sigma_k solved per generation from the weights, so a resume must solve the same
TARGET = ("--rollout_method", "latent", "--target_marginal_tv", "0.002", "--sigma_schedule", "constant")


def _cmd(out: Path, model: Path, data: Path, method: tuple[str, ...] = SPSA) -> list[str]:
    return [
        sys.executable, "-m", "ncgrpo", "train", "--config", str(TINY_RECIPE), "--output_dir", str(out),
        "--dataset_name", "geo3k", "--dataset_path", str(data), "--model_name_or_path", str(model),
        *method,
        "--num_generations", "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--max_completion_length", "6", "--max_steps", str(STEPS), "--save_strategy", "steps",
        "--save_steps", "1", "--resume",
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _finished(out: Path) -> bool:
    try:
        return bool(json.loads((out / "run.json").read_text()).get("finished"))
    except (OSError, ValueError):
        return False


def _run_to_end(out: Path, model: Path, data: Path, method: tuple[str, ...] = SPSA) -> None:
    r = subprocess.run(
        _cmd(out, model, data, method), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _resumed_step(out: Path) -> int:
    """The step a restart resumes from: the newest complete checkpoint (0: none)."""
    from ncgrpo.runs.folder import last_complete_checkpoint

    ckpt, _ = last_complete_checkpoint(out, nc_state=True)
    return 0 if ckpt is None else int(Path(ckpt).name.split("-")[1])


def _logged_steps(path: Path) -> set[int]:
    """Optimizer steps with a training log line (``loss``) in ``metrics.jsonl`` (torn lines ignored)."""
    steps = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except OSError:
        return steps
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and "loss" in row:
            steps.add(int(row["step"]))
    return steps


def _reached(out: Path, event: tuple[str, int], stale_inode: int | None) -> bool:
    """Whether the running attempt has reached ``event``: ``("logged", s)``, step ``s``'s log line is in
    metrics.jsonl (the kill then lands while checkpoint ``s`` is being written); ``("saved", s)``,
    checkpoint ``s`` is complete (the kill lands in step ``s + 1``). ``stale_inode``: the metrics file
    held lines past the resumed step, which the attempt cuts (a new file) first; until then its lines
    are the previous attempt's."""
    kind, step = event
    if kind == "saved":
        return (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    path = out / "metrics.jsonl"
    try:
        if stale_inode is not None and path.stat().st_ino == stale_inode:
            return False
    except OSError:
        return False
    return step in _logged_steps(path)


def _kill_loop(
    out: Path, model: Path, data: Path, kills: int, seed: int, method: tuple[str, ...] = SPSA
) -> list[tuple[str, int, float]]:
    """Start the run, SIGKILL it at a seeded point of its OBSERVED progress, repeat ``kills`` times or
    until it finished; then run it to the end. A kill point is an event of the attempt (a step logged,
    or a checkpoint written, at a seeded step that leaves training to do) plus a seeded delay of at most
    50 ms; no wall time measured elsewhere is involved, so a loaded machine or a fast one moves the
    kill with the run. Returns the kills that landed (event kind, step, delay)."""
    rng = random.Random(seed)
    landed = []
    for _ in range(kills):
        if _finished(out):
            break
        start = _resumed_step(out)
        if start >= STEPS - 1:
            break  # only the last step is left: no event of this attempt leaves work behind it
        metrics = out / "metrics.jsonl"
        stale = metrics.stat().st_ino if any(s > start for s in _logged_steps(metrics)) else None
        event = (rng.choice(("logged", "saved")), rng.randint(start + 1, STEPS - 1))
        delay = rng.uniform(0.0, 0.05)
        p = subprocess.Popen(
            _cmd(out, model, data, method), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 600
        while p.poll() is None and not _reached(out, event, stale):
            assert time.monotonic() < deadline, f"{event} not reached in 10 minutes"
            time.sleep(0.005)
        if p.poll() is None:
            time.sleep(delay)
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            landed.append((*event, delay))
        else:
            assert p.returncode == 0, p.stderr.read().decode()[-3000:]
    if not _finished(out):
        _run_to_end(out, model, data, method)
    return landed


def _check_same_as_uninterrupted(out: Path, ref: Path) -> None:
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed training ended in different weights"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "loss" in r]  # one training log per optimizer step
    assert logged == list(range(1, STEPS + 1)), logged


def _reference(tmp_path: Path, setup, method: tuple[str, ...] = SPSA) -> Path:
    model, data = setup
    ref = tmp_path / "ref"
    _run_to_end(ref, model, data, method)
    return ref


def test_train_killed_twice_resumes_to_the_same_weights(tmp_path: Path, setup) -> None:
    model, data = setup
    ref = _reference(tmp_path, setup)
    out = tmp_path / "killed"
    landed = _kill_loop(out, model, data, kills=2, seed=0)
    # the first kill waits for an event with at least one more optimizer step behind it, then <= 50 ms
    assert landed, "no kill landed before the run finished"
    _check_same_as_uninterrupted(out, ref)


def _logged(out: Path, name: str) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[name] for r in rows if "loss" in r]


def test_target_schedule_killed_twice_resumes_to_the_same_sigmas_and_weights(tmp_path: Path, setup) -> None:
    """target_marginal_tv: each sigma_k is solved from the weights and batch of its step, and the solve
    draws no random state, so a run killed twice and resumed solves the uninterrupted run's sigma_k
    sequence bit for bit and ends in its weights."""
    model, data = setup
    ref = _reference(tmp_path, setup, TARGET)
    out = tmp_path / "killed"
    landed = _kill_loop(out, model, data, kills=2, seed=1, method=TARGET)
    assert landed, "no kill landed before the run finished"
    _check_same_as_uninterrupted(out, ref)
    sigmas = _logged(ref, "noise/sigma_k")
    assert _logged(out, "noise/sigma_k") == sigmas and len(set(sigmas)) == STEPS  # solved anew each step
    assert _logged(out, "noise/target_achieved_tv") == _logged(ref, "noise/target_achieved_tv")


@pytest.mark.slow
def test_train_killed_20_times_resumes_to_the_same_weights(tmp_path: Path, setup) -> None:
    model, data = setup
    ref = _reference(tmp_path, setup)
    landed = []
    for seed in range(20):  # a fresh run per seed, so every kill lands somewhere new
        out = tmp_path / f"killed-{seed}"
        t0 = time.monotonic()
        landed += _kill_loop(out, model, data, kills=3, seed=seed)
        _check_same_as_uninterrupted(out, ref)
        assert time.monotonic() - t0 < 600
        if len(landed) >= 20:
            break
    assert len(landed) >= 20, f"only {len(landed)} kills landed before a run finished"


def test_two_trains_into_one_folder_the_second_exits_2_at_once_naming_the_holder(
    tmp_path: Path, setup
) -> None:
    """Issue 26, item 1: real processes. The second ``ncgrpo train`` is started once the first holds
    the folder (its pid in the lock file and its run.json written: observed, not timed) and the first
    is then paused (SIGSTOP) until the second has exited, so the first cannot finish before the second
    looks, however fast or loaded the machine. The second exits 2 naming the holder and writes
    nothing; the first, resumed, finishes with every step logged once and its own seed in run.json."""
    from ncgrpo.runs.folder import LOCK_FILE

    model, data = setup
    out = tmp_path / "run"
    base = [a for a in _cmd(out, model, data) if a != "--resume"]
    base += ["--max_steps", "2", "--save_strategy", "no"]
    first = subprocess.Popen(
        [*base, "--seed", "1"], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 600
        while first.poll() is None:
            assert time.monotonic() < deadline, "the first run never took its folder"
            try:
                held = (out / LOCK_FILE).read_text().startswith(f"pid {first.pid} ")
            except OSError:
                held = False
            if held and (out / "run.json").is_file():
                break
            time.sleep(0.01)
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        os.kill(first.pid, signal.SIGSTOP)
        try:
            before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
            second = subprocess.run(
                [*base, "--seed", "2"], env=_env(), capture_output=True, text=True, timeout=300
            )
            after = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            f"is being written by another process (pid {first.pid} (ncgrpo train) on host " in second.stderr
        )
        assert "--seed 1" in second.stderr  # the holder's command line
        assert before == after  # the second wrote nothing
        assert first.wait(timeout=600) == 0, first.stderr.read().decode()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    run = json.loads((out / "run.json").read_text())
    assert run["seed"] == 1 and run["finished"] and run["kind"] == "train"
