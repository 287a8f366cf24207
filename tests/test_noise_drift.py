"""scripts/noise_drift.py: the windows of a fixed-sigma and a target-schedule run's metrics, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "noise_drift.py"


def _run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _call(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_windows_drift_and_the_largest_miss(tmp_path: Path) -> None:
    fixed = _run(tmp_path / "fixed", [{"step": 0, "val/accuracy": 0.3}] + [
        {"step": k, "loss": 0.0, "noise/sigma_k": 0.2 if k <= 4 else 0.05, "noise/first_token_marginal_tv": 0.01 * k}
        for k in range(1, 7)
    ])  # fmt: skip
    target = _run(tmp_path / "target", [
        {"step": k, "loss": 0.0, "noise/sigma_k": 0.1 * k, "noise/target_marginal_tv": 0.01,
         "noise/first_token_marginal_tv": 0.0105 if k == 2 else 0.01}
        for k in range(1, 5)
    ])  # fmt: skip
    r = _call(fixed, target, "--window", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # sigma falls below half its start after step 4: steps 1-4 in windows of 2
    assert lines[2] == "| fixed | sigma0 0.2 | 4 | 1-2: 0.0150 (σ 0.200); 3-4: 0.0350 (σ 0.200) |  |"
    assert lines[3].startswith("| target | target TV 0.01 | 4 | 1-2: 0.0103 of 0.0100 (σ 0.150)")
    assert lines[3].endswith("| 5.0% |")


def test_a_folder_without_metrics_is_named(tmp_path: Path) -> None:
    r = _call(tmp_path)
    assert r.returncode != 0 and f"{tmp_path / 'metrics.jsonl'} does not exist" in r.stderr
    _run(tmp_path / "torn", [{"step": 1}])
    (tmp_path / "torn" / "metrics.jsonl").write_text('{"step": 1, "loss"\n')
    r = _call(tmp_path / "torn")
    assert r.returncode != 0 and "metrics.jsonl:1: not valid JSON" in r.stderr
