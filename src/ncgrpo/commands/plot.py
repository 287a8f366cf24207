"""``ncgrpo plot gains|dynamics``: the paper's figures from saved records and metrics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ncgrpo.commands.compare import _split


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="figures (gains vs. baseline, training dynamics) from saved files")
    sub = p.add_subparsers(dest="figure", metavar="FIGURE", required=True)

    g = sub.add_parser(
        "gains",
        help="accuracy gains (pp) per benchmark vs. a baseline, * for McNemar p<0.05",
        description="Grouped bars of each configuration's accuracy difference vs. the baseline; "
        "writes OUT/gains.png and OUT/gains.pdf.",
    )
    g.add_argument("runs", nargs="+", metavar="RUN_DIR", help="evaluation run directories")
    g.add_argument("--baseline", required=True, metavar="NAME")
    g.add_argument("--benchmarks", metavar="A,B", help="comma-separated benchmarks (in this order)")
    g.add_argument("--out", required=True, type=Path, metavar="DIR")
    g.add_argument("--name", default="gains", help="file stem (default: gains)")
    g.set_defaults(func=run_gains)

    d = sub.add_parser(
        "dynamics",
        help="training reward and validation accuracy against step",
        description="Reads TRAIN_DIR/metrics.jsonl of each run; writes OUT/dynamics.png and .pdf.",
    )
    d.add_argument("train_dirs", nargs="+", metavar="TRAIN_DIR")
    d.add_argument("--out", required=True, type=Path, metavar="DIR")
    d.add_argument("--reward-key", default="reward", help="metric plotted on top (default: reward)")
    d.add_argument(
        "--val-key",
        default="val/accuracy",
        help="comma-separated validation metric(s), one panel each; a prefix such as val/accuracy "
        "expands to val/accuracy/<benchmark> when only those are logged (default: val/accuracy)",
    )
    d.add_argument("--name", default="dynamics", help="file stem (default: dynamics)")
    d.set_defaults(func=run_dynamics)
    return p


def run_gains(args: argparse.Namespace) -> int:
    from ncgrpo.eval.plots import plot_gains
    from ncgrpo.eval.report import load_runs

    try:
        paths = plot_gains(
            load_runs(args.runs), args.baseline, args.out / args.name, benchmarks=_split(args.benchmarks)
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"ncgrpo plot gains: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_dynamics(args: argparse.Namespace) -> int:
    from ncgrpo.eval.plots import plot_dynamics

    try:
        paths = plot_dynamics(
            args.train_dirs,
            args.out / args.name,
            reward_key=args.reward_key,
            val_key=_split(args.val_key) or "val/accuracy",
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"ncgrpo plot dynamics: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
