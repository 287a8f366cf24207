"""``ncgrpo compare RUN_DIR... --baseline NAME``: the paper's tables with paired McNemar tests."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _split(text: str | None) -> list[str] | None:
    return [b.strip() for b in text.split(",") if b.strip()] if text else None


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="paper-style tables and paired exact McNemar tests from evaluation run directories",
        description="Compare evaluated checkpoints question by question. Runs with the same `name` in "
        "run.json are seeds of one configuration (mean ± half-range; tests pool seed pairs). "
        "Prints the tables; with --out also writes comparison.md, comparison.tex, comparison.json.",
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="directories holding run.json and records.jsonl"
    )
    p.add_argument("--baseline", required=True, metavar="NAME", help="configuration name to test against")
    p.add_argument("--benchmarks", metavar="A,B", help="comma-separated benchmarks (columns, in this order)")
    p.add_argument("--out", metavar="DIR", type=Path, help="write comparison.{md,tex,json} here")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ncgrpo.eval.records import atomic_write_json, atomic_write_text
    from ncgrpo.eval.report import compare, load_runs, print_rich, to_latex, to_markdown

    try:
        ct = compare(load_runs(args.runs), args.baseline, _split(args.benchmarks))
    except (ValueError, FileNotFoundError) as e:
        print(f"ncgrpo compare: error: {e}", file=sys.stderr)
        return 2
    print_rich(ct)
    if args.out is not None:
        atomic_write_text(args.out / "comparison.md", to_markdown(ct))
        atomic_write_text(args.out / "comparison.tex", to_latex(ct))
        atomic_write_json(args.out / "comparison.json", json.loads(json.dumps(ct.to_json(), default=str)))
        print(f"wrote {args.out / 'comparison.md'}, comparison.tex, comparison.json")
    return 0
