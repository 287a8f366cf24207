"""``ncgrpo pretrain --out DIR [--seed N] [--steps N] [--eval/--no-eval]``: build the embedded base model.

Supervised warm-up of a tiny Qwen2.5-VL on the synthetic suite's reasoning traces (see
:mod:`ncgrpo.toy.pretrain`), then (with ``--eval``) greedy accuracy per family on the suite's validation
split and the share of in-domain groups with mixed rewards, printed as a table and written to
``DIR/pretrain.json`` next to the model and processor.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "build the embedded tiny base VL model by supervised warm-up on the synthetic suite"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ncgrpo.toy.pretrain import DEFAULT_STEPS, DEFAULT_VISION_WARMUP

    p = sub.add_parser("pretrain", help=HELP, description=HELP)
    p.add_argument("--out", required=True, type=Path, help="output folder (model, processor, pretrain.json)")
    p.add_argument(
        "--seed", type=int, default=0, help="initialisation / data-order / SFT-pool seed (default 0)"
    )
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"optimiser steps (default {DEFAULT_STEPS})"
    )
    p.add_argument(
        "--size", default="tiny", help="model size: tiny (the embedded base model) or micro (tests)"
    )
    p.add_argument(
        "--pool",
        default=None,
        metavar="FAMILY=N,...",
        help="SFT pool items per family, e.g. geometry=1200,pope=300 (default: ncgrpo.toy.pretrain.DEFAULT_POOL)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--vision-warmup-steps",
        type=int,
        default=DEFAULT_VISION_WARMUP,
        help="steps of vision-tower pre-training on scene attributes before SFT "
        f"(default {DEFAULT_VISION_WARMUP}; 0 skips it)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: pretrain's)")
    p.add_argument("--suite-seed", type=int, default=0, help="seed of the synthetic suite evaluated on")
    p.add_argument(
        "--eval",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="evaluate on the validation split after training (default on)",
    )
    p.add_argument("--eval-limit", type=int, default=None, help="at most N validation questions per family")
    p.add_argument("--group-size", type=int, default=8, help="G for the mixed-reward share (default 8)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: reproducible, fast on busy CPUs)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def parse_pool(text: str) -> dict[str, int]:
    """``"geometry=1200,pope=300"`` -> ``{"geometry": 1200, "pope": 300}`` (families checked by pretrain)."""
    pool: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected FAMILY=N, got {part.strip()!r}")
        try:
            pool[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"count for {name.strip()!r} must be an integer, got {value!r}") from None
    return pool


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from ncgrpo.toy.pretrain import MIXED_GROUP_TARGET, SIZES, TARGET_BAND, pretrain

    console = Console()
    if args.size not in SIZES:
        console.print(f"[red]--size {args.size!r} is unknown; choose one of {', '.join(sorted(SIZES))}[/red]")
        return 2
    if args.steps < 1:
        console.print(f"[red]--steps must be >= 1, got {args.steps}[/red]")
        return 2
    if args.vision_warmup_steps < 0:
        console.print(f"[red]--vision-warmup-steps must be >= 0, got {args.vision_warmup_steps}[/red]")
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        console.print(f"[red]{args.out} exists and is not empty; pass a new --out folder[/red]")
        return 2
    extra: dict = {} if args.lr is None else {"lr": args.lr}
    if args.pool:
        try:
            extra["pool"] = parse_pool(args.pool)
        except ValueError as e:
            console.print(f"[red]--pool: {e}[/red]")
            return 2
    with tqdm(total=args.steps, desc="pretrain", unit="step", disable=args.no_progress) as bar:

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        try:
            report = pretrain(
                args.out,
                seed=args.seed,
                steps=args.steps,
                size=args.size,
                batch_size=args.batch_size,
                vision_warmup_steps=args.vision_warmup_steps,
                suite_seed=args.suite_seed,
                run_eval=args.eval,
                eval_limit=args.eval_limit,
                group_size=args.group_size,
                num_threads=args.threads,
                progress=progress,
                **extra,
            )
        except ValueError as e:
            console.print(f"[red]{e}[/red]")
            return 2

    params = report.parameters
    console.print(
        f"saved {args.out} | {params['total']:,} parameters (vision {params.get('vision', 0):,}) | "
        f"{report.checkpoint_bytes / 1e6:.1f} MB | train {report.train_time_s:.0f} s, "
        f"total {report.wall_time_s:.0f} s | final loss {report.losses[-1]:.3f}"
    )
    if not args.eval:
        return 0
    table = Table(title=f"base model on the validation split (suite seed {report.suite_seed})")
    table.add_column("family")
    table.add_column("n", justify="right")
    table.add_column("greedy acc", justify="right")
    table.add_column(f"sampled acc (T=1, G={report.group_size})", justify="right")
    table.add_column("mixed groups", justify="right")
    for fam, acc in report.accuracy.items():
        table.add_row(
            fam,
            str(report.eval_questions.get(fam, "")),
            f"{100 * acc:.1f}%",
            f"{100 * report.sample_accuracy[fam]:.1f}%" if fam in report.sample_accuracy else "",
            f"{100 * report.mixed_share[fam]:.1f}%" if fam in report.mixed_share else "",
        )
    console.print(table)
    lo, hi = TARGET_BAND
    console.print(
        f"in-domain greedy accuracy in [{100 * lo:.0f}%, {100 * hi:.0f}%]: "
        f"{'[green]yes' if report.in_band else '[red]no'}[/]; "
        f"mixed-reward groups >= {100 * MIXED_GROUP_TARGET:.0f}%: "
        f"{'[green]yes' if report.mixed_ok else '[red]no'}[/]"
    )
    return 0
