"""``ncgrpo train`` killed at random points (real SIGKILL, real subprocesses) and resumed with
``--resume`` until it finishes: the final weights equal an uninterrupted run's, and every step is
logged once. A fast variant (2 kills) runs by default; the 20-kill one is marked slow."""

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


def _cmd(out: Path, model: Path, data: Path) -> list[str]:
    return [
        sys.executable, "-m", "ncgrpo", "train", "--config", str(TINY_RECIPE), "--output_dir", str(out),
        "--dataset_name", "geo3k", "--dataset_path", str(data), "--model_name_or_path", str(model),
        "--rollout_method", "spsa", "--sigma0", "1.0", "--spsa_lr", "5.0",
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


def _run_to_end(out: Path, model: Path, data: Path) -> None:
    r = subprocess.run(_cmd(out, model, data), env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _kill_loop(out: Path, model: Path, data: Path, kills: int, seed: int, span: float) -> list[float]:
    """Start, SIGKILL after a seeded random time in (0.1, 0.95) x ``span`` (an uninterrupted run's
    wall time), repeat ``kills`` times or until the run finished; then run it to the end."""
    rng = random.Random(seed)
    landed = []
    for _ in range(kills):
        if _finished(out):
            break
        p = subprocess.Popen(
            _cmd(out, model, data), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        wait = rng.uniform(0.1 * span, 0.95 * span)
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            landed.append(wait)
        else:
            assert p.returncode == 0, p.stderr.read().decode()[-3000:]
    if not _finished(out):
        _run_to_end(out, model, data)
    return landed


def _check_same_as_uninterrupted(out: Path, ref: Path) -> None:
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed training ended in different weights"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows if "loss" in r]  # one training log per optimizer step
    assert logged == list(range(1, STEPS + 1)), logged


def _reference(tmp_path: Path, setup) -> tuple[Path, float]:
    model, data = setup
    ref = tmp_path / "ref"
    t0 = time.monotonic()
    _run_to_end(ref, model, data)
    return ref, time.monotonic() - t0


def test_train_killed_twice_resumes_to_the_same_weights(tmp_path: Path, setup) -> None:
    model, data = setup
    ref, span = _reference(tmp_path, setup)
    out = tmp_path / "killed"
    landed = _kill_loop(out, model, data, kills=2, seed=0, span=span)
    assert landed, "no kill landed before the run finished"
    _check_same_as_uninterrupted(out, ref)


@pytest.mark.slow
def test_train_killed_20_times_resumes_to_the_same_weights(tmp_path: Path, setup) -> None:
    model, data = setup
    ref, span = _reference(tmp_path, setup)
    landed = []
    for seed in range(20):  # a fresh run per seed, so every kill lands somewhere new
        out = tmp_path / f"killed-{seed}"
        t0 = time.monotonic()
        landed += _kill_loop(out, model, data, kills=3, seed=seed, span=span)
        _check_same_as_uninterrupted(out, ref)
        assert time.monotonic() - t0 < 600
        if len(landed) >= 20:
            break
    assert len(landed) >= 20, f"only {len(landed)} kills landed before a run finished"
