"""``ncgrpo plot gains|dynamics``: the paper's figures from saved records and metrics."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command, check_report_folder, report_folder
from ncgrpo.commands.compare import names_list, run_dirs

GAINS_HELP = "accuracy gains (pp) per benchmark vs. a baseline, * for McNemar p<0.05"
DYNAMICS_HELP = "training reward, validation accuracy and the noise (first-token TV, sigma_k) against step"


def _stem(name: str) -> str:
    if not name.strip() or "/" in name or name in (".", ".."):
        raise UsageError(f"--name {name!r}: give a plain file stem such as gains (no folder)")
    return name


def _out_folder(out: str) -> str:
    if not str(out).strip():
        raise UsageError("--output_dir is empty")
    if Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"--output_dir {out} exists and is not a folder")
    check_report_folder(out, "ncgrpo plot")
    return out


@dataclass
class GainsArgs:
    """Options of ``ncgrpo plot gains``."""

    runs: list[str] = field(metadata={"help": "evaluation run folders, space-separated"})
    baseline: str = field(metadata={"help": "configuration name (run.json `name`) to compare against"})
    output_dir: str = field(metadata={"help": "output folder: NAME.png and NAME.pdf (was --out)"})
    benchmarks: list[str] | None = field(default=None, metadata={"help": "benchmarks to show, in this order"})
    name: str = field(default="gains", metadata={"help": "file stem"})

    def __post_init__(self) -> None:
        self.runs = run_dirs(self.runs)
        if not self.baseline.strip():
            raise UsageError("--baseline is empty; give the name of the baseline configuration")
        self.benchmarks = names_list(self.benchmarks, "--benchmarks")
        self.output_dir = _out_folder(self.output_dir)
        self.name = _stem(self.name)


@dataclass
class DynamicsArgs:
    """Options of ``ncgrpo plot dynamics``."""

    train_dirs: list[str] = field(
        metadata={"help": "training run folders holding metrics.jsonl, space-separated"}
    )
    output_dir: str = field(metadata={"help": "output folder: NAME.png and NAME.pdf (was --out)"})
    reward_key: str = field(default="reward", metadata={"help": "metric plotted on top"})
    val_key: list[str] = field(
        default_factory=lambda: ["val/accuracy"],
        metadata={
            "help": "validation metric(s), one panel each, space-separated; a prefix such as val/accuracy "
            "expands to val/accuracy/<benchmark> when only those are logged"
        },
    )
    smooth: int = field(
        default=10,
        metadata={
            "help": "the reward's rolling mean: a centred window of this many steps over the faint "
            "per-step line (1: per-step line only)"
        },
    )
    noise_panel: bool = field(
        default=True,
        metadata={
            "help": "the noise panel (first-token TV noise-averaged and per draw, sigma_k), drawn when a "
            "run logged them; --no_noise_panel leaves it out"
        },
    )
    name: str = field(default="dynamics", metadata={"help": "file stem"})

    def __post_init__(self) -> None:
        self.train_dirs = run_dirs(self.train_dirs, "--train_dirs")
        if not self.reward_key.strip():
            raise UsageError("--reward_key is empty")
        if self.smooth < 1:
            raise UsageError(f"--smooth {self.smooth}: give a window of at least 1 step (1: no smoothing)")
        self.val_key = names_list(self.val_key, "--val_key")
        self.output_dir = _out_folder(self.output_dir)
        self.name = _stem(self.name)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="figures (gains vs. baseline, training dynamics) from saved files")
    sub = p.add_subparsers(dest="figure", metavar="FIGURE", required=True)
    add_dataclass_command(
        sub,
        "gains",
        GainsArgs,
        run_gains,
        help=GAINS_HELP,
        description="Grouped bars of each configuration's accuracy difference vs. the baseline; "
        "writes OUT/NAME.png and OUT/NAME.pdf.",
        command_name="plot gains",
    )
    add_dataclass_command(
        sub,
        "dynamics",
        DynamicsArgs,
        run_dynamics,
        help=DYNAMICS_HELP,
        description="Reads TRAIN_DIR/metrics.jsonl of each run; writes OUT/NAME.png and OUT/NAME.pdf. "
        "Runs that logged noise/first_token_marginal_tv, noise/first_token_tv or noise/sigma_k get a "
        "noise panel (runs without them, such as vanilla GRPO, are absent from it).",
        command_name="plot dynamics",
    )
    return p


def run_gains(args: GainsArgs) -> int:
    from ncgrpo.eval.plots import plot_gains
    from ncgrpo.eval.report import load_runs

    runs = load_runs(args.runs)
    with report_folder(args.output_dir, "ncgrpo plot gains") as out:
        paths = plot_gains(runs, args.baseline, out / args.name, benchmarks=args.benchmarks)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_dynamics(args: DynamicsArgs) -> int:
    from ncgrpo.eval.plots import plot_dynamics

    with report_folder(args.output_dir, "ncgrpo plot dynamics") as out:
        paths = plot_dynamics(
            args.train_dirs,
            out / args.name,
            reward_key=args.reward_key,
            val_key=args.val_key,
            smooth=args.smooth,
            noise_panel=args.noise_panel,
        )
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
