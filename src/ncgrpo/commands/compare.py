"""``ncgrpo compare --runs RUN_DIR... --baseline NAME``: the paper's tables with paired McNemar tests,
and, where a configuration has several seeds, the seed-level test beside them (``ncgrpo.eval.report``)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command, check_report_folder, report_folder
from ncgrpo.runs.folder import atomic_write_json, atomic_write_text, folder_kind

HELP = "paper-style tables, paired exact McNemar tests and seed-level tests from evaluation run directories"
DESCRIPTION = (
    "Compare evaluated checkpoints question by question. Runs with the same `name` in run.json are seeds "
    "of one configuration (mean ± half-range). The McNemar tests pool the seed pairs (question-level: "
    "questions are their only source of variance); with several seeds a configuration also gets the "
    "seed-level test, a paired t-test over training seeds of its accuracy difference (with a hierarchical "
    "bootstrap interval), the difference that test detects with 80% power and the seeds the observed "
    "difference would need, beside the baseline's seed-to-seed difference as a reference and a note where "
    "the two tests disagree; with one seed, a note that no seed-level claim can be made. Prints the tables; "
    "with --output_dir also writes comparison.md, comparison.tex, comparison.json."
)


def names_list(values: list[str] | None, flag: str) -> list[str] | None:
    """Space-separated names (commas also split); an empty name is an error."""
    if values is None:
        return None
    out: list[str] = []
    for item in values:
        parts = [p.strip() for p in str(item).split(",")]
        if not all(parts):
            raise UsageError(f"{flag} {item!r}: empty name; give names separated by spaces")
        out += parts
    if not out:
        raise UsageError(f"{flag} needs at least one name")
    return out


def run_dirs(values: list[str], flag: str = "--runs") -> list[str]:
    """Run folders: each must be a folder (what it holds is checked when read)."""
    if not values:
        raise UsageError(f"{flag} needs at least one folder")
    seen: dict[Path, str] = {}
    for v in values:
        if not Path(v).is_dir():
            raise UsageError(f"{flag}: {v} is not a folder")
        key = Path(v).resolve()
        if key in seen:
            raise UsageError(f"{flag}: the same folder twice ({seen[key]} and {v}); give each run once")
        seen[key] = v
    return list(values)


def _kind(folder: str | Path) -> str | None:
    try:
        return folder_kind(folder)
    except ValueError as e:  # an unreadable run.json: named by the reader
        raise UsageError(str(e)) from None


def _demo_runs(root: str | Path, sub: str, holds: str) -> list[str]:
    """The run folders of a demo's output folder: ``ROOT/<sub>/*`` that hold ``holds``, sorted."""
    found = sorted(str(d) for d in (Path(root) / sub).glob("*") if (d / holds).is_file())
    if not found:
        raise UsageError(f"{root} is a demo's folder but {Path(root) / sub} holds no run with {holds}")
    return found


def eval_dirs(values: list[str], flag: str = "--runs") -> list[str]:
    """Evaluation folders (``ncgrpo eval``'s): a demo's output folder stands for its evaluations
    (``DEMO/eval/*``); a training run is refused, naming what reads it."""
    out: list[str] = []
    for v in run_dirs(values, flag):
        kind = _kind(v)
        if kind == "demo":
            out += _demo_runs(v, "eval", "records.jsonl")
        elif kind == "train":
            raise UsageError(
                f"{flag}: {v} is a training run, not an evaluation: evaluate it first (ncgrpo eval "
                f"--model_name_or_path {v} --benchmarks ...), or draw its training curves with ncgrpo plot "
                "dynamics"
            )
        else:
            out.append(v)
    return run_dirs(out, flag)


#: ``--allow_different``'s help (``compare`` and ``plot gains``).
ALLOW_DIFFERENT_HELP = (
    "decoding settings the runs may differ in, space-separated: max_new_tokens, grader, engine; the "
    "differences are printed above the tables. None: runs evaluated with other settings (or other "
    "benchmark data) are refused, naming the difference"
)


def allowed_differences(values: list[str] | None) -> list[str]:
    """``--allow_different``'s fields, each one that runs may differ in
    (:data:`ncgrpo.eval.report.conditions.MAY_DIFFER`)."""
    from ncgrpo.eval.report.conditions import MAY_DIFFER

    fields = names_list(values, "--allow_different") or []
    bad = [f for f in fields if f not in MAY_DIFFER]
    if bad:
        raise UsageError(
            f"--allow_different {' '.join(bad)}: not a setting runs may differ in; one of "
            f"{', '.join(MAY_DIFFER)} (the prompts and the benchmark data must be the same to pair questions)"
        )
    return fields


@dataclass
class CompareArgs:
    """Options of ``ncgrpo compare`` (checked in ``__post_init__``)."""

    runs: list[str] = field(
        metadata={
            "help": "evaluation run folders (run.json + records.jsonl), space-separated; a demo's folder "
            "stands for its evaluations"
        }
    )
    baseline: str = field(metadata={"help": "configuration name (run.json `name`) to test against"})
    benchmarks: list[str] | None = field(
        default=None, metadata={"help": "benchmarks to show (columns, in this order); none: all"}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "write comparison.{md,tex,json} into this folder (was --out)"}
    )
    allow_different: list[str] | None = field(default=None, metadata={"help": ALLOW_DIFFERENT_HELP})

    def __post_init__(self) -> None:
        self.runs = eval_dirs(self.runs)
        self.allow_different = allowed_differences(self.allow_different)
        if not self.baseline.strip():
            raise UsageError("--baseline is empty; give the name of the baseline configuration")
        self.benchmarks = names_list(self.benchmarks, "--benchmarks")
        if (
            self.output_dir is not None
            and Path(self.output_dir).exists()
            and not Path(self.output_dir).is_dir()
        ):
            raise UsageError(f"--output_dir {self.output_dir} exists and is not a folder")
        if self.output_dir is not None:
            check_report_folder(self.output_dir, "ncgrpo compare")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    add_dataclass_command(subparsers, "compare", CompareArgs, run, help=HELP, description=DESCRIPTION)


def run(args: CompareArgs) -> int:
    from ncgrpo.eval.report import compare, load_runs, print_rich, to_latex, to_markdown

    ct = compare(load_runs(args.runs), args.baseline, args.benchmarks, allow_different=args.allow_different)
    print_rich(ct)
    if args.output_dir is not None:
        with report_folder(args.output_dir, "ncgrpo compare") as out:
            atomic_write_text(out / "comparison.md", to_markdown(ct))
            atomic_write_text(out / "comparison.tex", to_latex(ct))
            atomic_write_json(out / "comparison.json", json.loads(json.dumps(ct.to_json(), default=str)))
        print(f"wrote {out / 'comparison.md'}, comparison.tex, comparison.json")
    return 0
