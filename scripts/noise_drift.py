"""What the noise did over training runs, from their ``metrics.jsonl``: the noise-averaged first-token TV
``noise/first_token_marginal_tv`` (what the noisy half samples from; "of": the annealed target's mean) and
``noise/sigma_k`` by windows of steps, before eq. (3)'s anneal (steps where ``sigma_k`` or the target is at
least half its start).

A fixed-sigma run (``sigma0``) shows whether the TV drifts as RL changes the policy; a target-schedule run
(``target_marginal_tv``) shows the sigma it needed to hold the target, and the largest relative miss
``|TV / target - 1|`` at any logged step. Prints a Markdown table (docs/embedded-base.md, issue 36)::

    python scripts/noise_drift.py RUN_DIR [RUN_DIR ...] [--window 20]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    """The training steps of ``RUN/metrics.jsonl`` that logged ``noise/sigma_k`` (read as the project
    reads every JSONL file: :func:`ncgrpo.runs.folder.iter_json_lines`, a torn tail skipped)."""
    from ncgrpo.runs.folder import iter_json_lines

    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"noise_drift: error: {path} does not exist (a training run's folder?)")
    try:
        rows = [
            row for _, row in iter_json_lines(path, "metrics row") if "loss" in row and "noise/sigma_k" in row
        ]
    except ValueError as e:
        raise SystemExit(f"noise_drift: error: {e}") from None
    if not rows:
        raise SystemExit(f"noise_drift: error: {path} has no training step with noise/sigma_k")
    return rows


def summarize(run: Path, window: int) -> dict:
    """Per window of ``window`` steps before the anneal: mean TV and mean sigma_k; and for a target run the
    largest ``|TV / target - 1|`` over those steps."""
    rows = _rows(run)
    target = "noise/target_marginal_tv" in rows[0]
    key = "noise/target_marginal_tv" if target else "noise/sigma_k"
    start = rows[0][key]
    live = [r for r in rows if r[key] >= 0.5 * start and "noise/first_token_marginal_tv" in r]
    windows = []
    for lo in range(0, len(live), window):
        part = live[lo : lo + window]
        windows.append(
            (
                part[0]["step"],
                part[-1]["step"],
                sum(r["noise/first_token_marginal_tv"] for r in part) / len(part),
                sum(r["noise/sigma_k"] for r in part) / len(part),
                sum(r["noise/target_marginal_tv"] for r in part) / len(part) if target else None,
            )
        )
    miss = (
        max(abs(r["noise/first_token_marginal_tv"] / r["noise/target_marginal_tv"] - 1) for r in live)
        if target
        else math.nan
    )
    return {"run": run.name, "target": start if target else None, "sigma0": None if target else start,
            "steps": len(live), "windows": windows, "max_miss": miss}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="training run folders (a demo's DEMO/train/RUN)")
    ap.add_argument("--window", type=int, default=20, help="steps per window (default 20)")
    a = ap.parse_args(argv)
    if a.window < 1:
        ap.error("--window must be >= 1")
    print(
        "| run | set by | steps before the anneal | marginal TV by window (mean sigma_k) | max abs(TV/target - 1) |"
    )
    print("|---|---|---:|---|---:|")
    for run in a.runs:
        s = summarize(run, a.window)
        by = f"target TV {s['target']:.4g}" if s["target"] is not None else f"sigma0 {s['sigma0']:g}"
        cells = "; ".join(
            f"{lo}-{hi}: {tv:.4f}" + (f" of {goal:.4f}" if goal is not None else "") + f" (σ {sg:.3f})"
            for lo, hi, tv, sg, goal in s["windows"]
        )
        miss = "" if math.isnan(s["max_miss"]) else f"{100 * s['max_miss']:.1f}%"
        print(f"| {s['run']} | {by} | {s['steps']} | {cells} | {miss} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
