"""benchmarks/bench_loss_bf16.py at a tiny size: every arm is compared with the float32 reference, a
sampled completion never holds an image placeholder (the VL model would refuse it), and the JSON holds
the per-seed errors and their summary. A few seconds on the CPU."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_loss_bf16  # noqa: E402


def test_bench_loss_bf16_runs_and_reports_every_arm(tmp_path, capsys):
    out = tmp_path / "bf16.json"
    # seed 3, G = 2, C = 100 samples the image placeholder in a VL completion (which crashed before the remap)
    bench_loss_bf16.main(["--kinds", "text,vl", "--seeds", "3", "--G", "2", "--P", "96", "--C", "100",
                          "--pad", "8", "--out", str(out)])  # fmt: skip
    data = json.loads(out.read_text())
    assert [r["kind"] for r in data["runs"]] == ["text", "vl"]
    for r in data["runs"]:
        assert set(r["vs_fp32"]) == set(bench_loss_bf16.ARMS)
        assert set(r["vs_trl_1mb"]) == set(bench_loss_bf16.ARMS) - {"trl_1mb"}
        for arm, e in r["vs_fp32"].items():
            # bf16 shows rounding against float32, of bf16's size (not a broken comparison)
            assert 1e-4 < e["logp_max"] < 0.1 and 1e-4 < e["grad_rel_global"] < 0.1, (arm, e)
            assert all(math.isfinite(v) for k, v in e.items() if not k.endswith("_param"))
        # TRL in two micro-batches: each row's forward is the one-micro-batch one
        assert r["vs_trl_1mb"]["trl_2mb"]["logp_max"] == 0.0
    assert "| vl | shared | fp32 |" in capsys.readouterr().out
