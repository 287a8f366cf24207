"""``ncgrpo eval``: greedy, noise-free evaluation with crash-safe per-question records."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "evaluate a model greedily on benchmarks; one JSONL record per question (resumable)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help=HELP, description=HELP)
    p.add_argument("--model", required=True, help="model folder (save_pretrained layout) or cached hub id")
    p.add_argument(
        "--benchmarks",
        required=True,
        help="comma-separated benchmark names (geo3k, hallusionbench, mathvista, mathverse, mathvision, wemath, "
        "pope, mmstar, ai2d, realworldqa, chartqa) or 'synthetic' (an exported synthetic suite, see --data)",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder: run.json + records.jsonl")
    p.add_argument(
        "--data-dir", type=Path, default=None, help="root folder holding one sub-folder per benchmark"
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="data location of one benchmark (overrides --data-dir); repeatable",
    )
    p.add_argument(
        "--split", default=None, help="split to evaluate (default: each benchmark's own, e.g. testmini)"
    )
    p.add_argument("--limit", type=int, default=None, help="first N questions of each benchmark (smoke runs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--name", default=None, help="display name of this run in tables (default: the model id)")
    p.add_argument("--method", default=None, help="training method of the model, recorded in run.json")
    p.add_argument("--seed", type=int, default=None, help="training seed of the model, recorded per question")
    p.add_argument("--checkpoint", default=None, help="checkpoint label recorded per question")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _data_paths(args: argparse.Namespace, names: list[str]) -> dict[str, Path | None]:
    explicit: dict[str, Path] = {}
    for item in args.data:
        if "=" not in item:
            raise SystemExit(f"--data expects NAME=PATH, got {item!r}")
        k, v = item.split("=", 1)
        explicit[k.strip()] = Path(v)
    unknown = set(explicit) - set(names)
    if unknown:
        raise SystemExit(f"--data names {sorted(unknown)} are not among --benchmarks {names}")
    out: dict[str, Path | None] = {}
    for n in names:
        if n in explicit:
            out[n] = explicit[n]
        elif args.data_dir is not None and (args.data_dir / n).exists():
            out[n] = args.data_dir / n
        else:
            out[n] = None
    return out


def load_questions(names: list[str], paths: dict[str, Path | None], split: str | None, limit: int | None):
    from ncgrpo.data.benchmarks import BENCHMARKS, load_benchmark
    from ncgrpo.data.geometry3k import load_geometry3k

    questions = []
    for n in names:
        if n == "synthetic":
            if paths[n] is None:
                raise SystemExit("benchmark 'synthetic' needs --data synthetic=FOLDER (an exported suite)")
            questions += load_geometry3k(paths[n], split or "test", limit=limit)
        elif n in BENCHMARKS:
            questions += load_benchmark(n, paths[n], split=split, limit=limit)
        else:
            raise SystemExit(f"unknown benchmark {n!r}; known: synthetic, {', '.join(BENCHMARKS)}")
    return questions


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ncgrpo.eval.evaluate import DecodingSettings, evaluate, model_id_of
    from ncgrpo.training import load_model_and_processor

    names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    questions = load_questions(names, _data_paths(args, names), args.split, args.limit)
    model, processor = load_model_and_processor(args.model, dtype=args.dtype, device=args.device)
    summary = evaluate(
        model,
        processor,
        questions,
        args.out,
        model_id=model_id_of(args.model),
        checkpoint=args.checkpoint,
        seed=args.seed,
        name=args.name,
        method=args.method,
        settings=DecodingSettings(
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, system_prompt=args.system_prompt
        ),
        progress=not args.no_progress,
    )
    table = Table(title=f"{args.out} ({summary.newly_recorded} new of {summary.total})")
    table.add_column("benchmark")
    table.add_column("n", justify="right")
    table.add_column("accuracy %", justify="right")
    for b, a in summary.accuracy.items():
        table.add_row(b, str(summary.counts[b]), f"{100 * a:.1f}")
    Console().print(table)
    return 0
