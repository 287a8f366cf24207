"""``ncgrpo plot gains|dynamics``: the paper's figures from saved records and metrics."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command, check_report_folder, report_folder
from ncgrpo.commands.compare import (
    ALLOW_DIFFERENT_HELP,
    _demo_runs,
    _kind,
    allowed_differences,
    eval_dirs,
    names_list,
    run_dirs,
)
from ncgrpo.runs.folder import METRICS_FILE

GAINS_HELP = "accuracy gains (pp) per benchmark vs. a baseline, * for McNemar p<0.05"
DYNAMICS_HELP = "training reward, validation and the noise (first-token TV, sigma_k) against step"


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


def training_dirs(values: list[str], flag: str = "--train_dirs") -> list[str]:
    """Training run folders (``metrics.jsonl``): a demo's output folder stands for its training runs
    (``DEMO/train/*``); an evaluation, or a folder without metrics, is refused naming what it is."""

    out: list[str] = []
    for v in run_dirs(values, flag):
        kind = _kind(v)
        if kind == "demo":
            out += _demo_runs(v, "train", METRICS_FILE)
        elif kind == "eval":
            raise UsageError(
                f"{flag}: {v} is an evaluation (ncgrpo eval's records), not a training run: ncgrpo plot "
                "gains and ncgrpo compare read it; plot dynamics reads a training run's metrics.jsonl"
            )
        elif not (Path(v) / METRICS_FILE).is_file():
            what = f" ({kind})" if kind else ""
            raise UsageError(
                f"{flag}: {v}{what} has no {METRICS_FILE}; give a folder written by ncgrpo train or "
                "NCGRPOTrainer (or a demo's folder)"
            )
        else:
            out.append(v)
    return run_dirs(out, flag)


@dataclass
class GainsArgs:
    """Options of ``ncgrpo plot gains``."""

    runs: list[str] = field(
        metadata={
            "help": "evaluation run folders, space-separated; a demo's folder stands for its evaluations"
        }
    )
    baseline: str = field(metadata={"help": "configuration name (run.json `name`) to compare against"})
    output_dir: str = field(metadata={"help": "output folder: NAME.png and NAME.pdf (was --out)"})
    benchmarks: list[str] | None = field(default=None, metadata={"help": "benchmarks to show, in this order"})
    name: str = field(default="gains", metadata={"help": "file stem"})
    allow_different: list[str] | None = field(
        default=None, metadata={"help": ALLOW_DIFFERENT_HELP.replace("above the tables", "in the title")}
    )

    def __post_init__(self) -> None:
        self.runs = eval_dirs(self.runs)
        if not self.baseline.strip():
            raise UsageError("--baseline is empty; give the name of the baseline configuration")
        self.benchmarks = names_list(self.benchmarks, "--benchmarks")
        self.allow_different = allowed_differences(self.allow_different)
        self.output_dir = _out_folder(self.output_dir)
        self.name = _stem(self.name)


@dataclass
class DynamicsArgs:
    """Options of ``ncgrpo plot dynamics``."""

    train_dirs: list[str] = field(
        metadata={
            "help": "training run folders holding metrics.jsonl (ncgrpo train's), space-separated; a demo's "
            "folder stands for its training runs"
        }
    )
    output_dir: str = field(metadata={"help": "output folder: NAME.png and NAME.pdf (was --out)"})
    reward_key: str = field(default="reward", metadata={"help": "metric plotted on top"})
    val_key: list[str] | None = field(
        default=None,
        metadata={
            "help": "validation metric(s), one panel each, space-separated; a prefix such as val/accuracy "
            "expands to val/accuracy/<benchmark> when only those are logged. None: found from what the runs "
            "logged: the demo's val/accuracy and TRL's eval_reward (ncgrpo train --eval_strategy; "
            "eval_<set>_reward per eval set); a run trained without evaluation gets no validation panel"
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
        self.train_dirs = training_dirs(self.train_dirs, "--train_dirs")
        if not self.reward_key.strip():
            raise UsageError("--reward_key is empty")
        if self.smooth < 1:
            raise UsageError(f"--smooth {self.smooth}: give a window of at least 1 step (1: no smoothing)")
        self.val_key = names_list(self.val_key, "--val_key") if self.val_key is not None else None
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
        description="Reads TRAIN_DIR/metrics.jsonl of each run (a demo's folder: each of its training runs); "
        "writes OUT/NAME.png and OUT/NAME.pdf. The validation panels are what the runs logged (the demo's "
        "val/accuracy, TRL's eval_reward) unless --val_key names them; nothing is written when the input is "
        "refused. Runs that logged noise/first_token_marginal_tv, noise/first_token_tv or noise/sigma_k get a "
        "noise panel (runs without them, such as vanilla GRPO, are absent from it).",
        command_name="plot dynamics",
    )
    return p


def run_gains(args: GainsArgs) -> int:
    from ncgrpo.eval.plots import gains_figure, save_figure
    from ncgrpo.eval.report import compare, load_runs

    # the figure first: a refused input (an unknown baseline, runs that do not pair, runs evaluated
    # otherwise) writes nothing
    ct = compare(load_runs(args.runs), args.baseline, args.benchmarks, allow_different=args.allow_different)
    title = None
    if ct.differences:
        fields = ", ".join(d.split(" ", 1)[0] for d in ct.differences)
        title = (
            f"Gains over {ct.baseline} (its accuracy beneath each label; * p<0.05)\n"
            f"runs evaluated with different {fields} (--allow_different)"
        )
    fig = gains_figure(ct, None, title=title)
    with report_folder(args.output_dir, "ncgrpo plot gains") as out:
        paths = save_figure(fig, out / args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run_dynamics(args: DynamicsArgs) -> int:
    from ncgrpo.eval.plots import dynamics_figure, dynamics_keys, read_metrics, run_label, save_figure

    # the figure first: a refused input (a key no run logs, metrics without steps) writes nothing
    fig = dynamics_figure(
        args.train_dirs,
        reward_key=args.reward_key,
        val_key=args.val_key,
        smooth=args.smooth,
        noise_panel=args.noise_panel,
    )
    if args.val_key is None:
        runs = [(run_label(d), read_metrics(d)) for d in args.train_dirs]
        found = dynamics_keys(runs, args.reward_key)[1:]
        print(
            f"validation: {', '.join(found)}"
            if found
            else "validation: none logged (no val/accuracy or eval_reward; train with --eval_strategy steps "
            "and --eval_dataset_splits for one): reward and noise only"
        )
    with report_folder(args.output_dir, "ncgrpo plot dynamics") as out:
        paths = save_figure(fig, out / args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
