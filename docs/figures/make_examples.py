"""Regenerate docs/figures/example_gains.png and example_dynamics.png from SYNTHETIC files.

The records reproduce the per-benchmark accuracies of the paper's Table 1 on 1,000 made-up questions
per benchmark (so the p-values are not the paper's); the training metrics are made-up curves shaped
like the paper's Figure 1, plus, for the NC-GRPO runs, a made-up noise panel: sigma_k on the paper's
sigmoid schedule (eq. 3; k_mid = 40 of K = 60) with first-token TVs that follow it. Both go through the same code as `ncgrpo plot gains|dynamics`:

    python docs/figures/make_examples.py [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np

from ncgrpo.eval.plots import plot_dynamics, plot_gains
from ncgrpo.eval.records import EvalRecord, RecordWriter
from ncgrpo.eval.report import load_runs
from ncgrpo.runs.folder import RECORDS_FILE, RUN_FILE, atomic_write_json

N = 1000  # questions per benchmark
BENCHMARKS = [
    ("geo3k", "in_domain"),
    ("hallusionbench", "ood"),
    ("mathvista", "ood"),
    ("mathverse", "ood"),
    ("mathvision", "ood"),
    ("wemath", "ood"),
]
# Paper Table 1 accuracies (%), and how many questions each method loses beyond its net change
# (n01 = losses + deficit, n10 = losses + surplus): 0 makes a one-sided, clearly significant change.
TABLE1 = {
    "Vanilla GRPO": ([52.9, 70.2, 70.7, 43.0, 27.1, 49.1], None),
    "NC-GRPO σ0=0.2": ([53.9, 71.3, 70.1, 44.9, 28.4, 50.5], [40, 40, 40, 0, 40, 40]),
    "NC-GRPO σ0=0.5": ([53.7, 71.0, 71.2, 45.3, 27.6, 52.1], [40, 40, 40, 0, 40, 0]),
}


def write_eval_runs(root: Path) -> list[Path]:
    base_acc = TABLE1["Vanilla GRPO"][0]
    dirs = []
    for k, (name, (accs, losses)) in enumerate(TABLE1.items()):
        d = root / f"eval_{k}"
        atomic_write_json(d / RUN_FILE, {"name": name, "method": name, "seed": 1, "model": "synthetic"})
        with RecordWriter(d / RECORDS_FILE) as w:
            for j, ((bm, role), acc) in enumerate(zip(BENCHMARKS, accs, strict=True)):
                kb, km = round(base_acc[j] * N / 100), round(acc * N / 100)
                correct = np.arange(N) < kb  # baseline: the first kb questions
                if losses is not None:
                    correct[: losses[j] + max(0, kb - km)] = False
                    correct[kb : kb + losses[j] + max(0, km - kb)] = True
                w.write(
                    EvalRecord(bm, f"q{i:04d}", role, "", "", None, "", bool(c), "synthetic")
                    for i, c in enumerate(correct)
                )
        dirs.append(d)
    return dirs


def write_train_runs(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    dirs = []
    # name, final validation accuracy on (geo3k, mathverse), sigma_0 (None: no hidden-state noise)
    for k, (name, final, sigma0) in enumerate(
        [
            ("Vanilla GRPO", (0.529, 0.430), None),
            ("NoisyRollout (image)", (0.521, 0.465), None),
            ("NC-GRPO σ0=0.2", (0.539, 0.449), 0.2),
            ("NC-GRPO σ0=0.5", (0.537, 0.453), 0.5),
        ]
    ):
        d = root / f"train_{k}"
        atomic_write_json(d / "run.json", {"name": name})
        rows = []
        for step in range(61):
            row: dict = {
                "step": step,
                "reward": 0.45 + 0.3 * (1 - math.exp(-step / 18)) + rng.normal(0, 0.015),
            }
            if sigma0 is not None:  # what the trainer logs for hidden-noise methods
                sigma_k = sigma0 / (1 + math.exp(30 * (step - 40) / 60))
                per_draw = min(1.0, 1.1 * sigma_k) * (1 + rng.normal(0, 0.05))
                row["noise/sigma_k"] = sigma_k
                row["noise/first_token_tv"] = per_draw
                row["noise/first_token_marginal_tv"] = per_draw * (0.1 + rng.normal(0, 0.008))
            if step % 10 == 0:  # validation every 10 steps; other rows lack these keys
                frac = 1 - math.exp(-step / 25)
                for bm, start, end in [("geo3k", 0.44, final[0]), ("mathverse", 0.38, final[1])]:
                    row[f"val/accuracy/{bm}"] = start + (end - start) * frac / (1 - math.exp(-60 / 25))
            rows.append(row)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        dirs.append(d)
    return dirs


def main(out: Path) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = load_runs(write_eval_runs(tmp))
        paths = plot_gains(
            runs,
            "Vanilla GRPO",
            out / "example_gains",
            title="Example (synthetic records with Table 1's accuracies): gains over Vanilla GRPO",
        )
        paths += plot_dynamics(
            write_train_runs(tmp),
            out / "example_dynamics",
            title="Example (synthetic metrics): training reward, validation accuracy and the noise",
        )
    for p in paths:  # the docs show PNGs; the PDFs are for papers
        if p.suffix == ".pdf":
            p.unlink()
    return [p for p in paths if p.suffix == ".png"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    for p in main(ap.parse_args().out):
        print(p)
