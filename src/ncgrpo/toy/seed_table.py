"""The README's several-seed table of ``ncgrpo demo`` runs, read from their per-question records.

``ncgrpo demo --seeds 3`` prints the paper's tables (per family and pooled OOD, against vanilla). This
module adds the view a toy needs to be read honestly: each seed's in-domain accuracy and its exact
McNemar test against the untrained base model (did GRPO learn at all?), the share of in-domain
questions whose outcome differs from vanilla's in the same seed (did the method change anything?),
one McNemar test pooled over the seeds against vanilla, and the share of greedy answers that take the
warm-up's image-blind shortcut (:func:`ncgrpo.toy.synthetic.shortcut_trace`).

Several demo folders may be given (e.g. one per process, split with ``--rollout_methods``): rows are
keyed by run folder name, the base model and vanilla GRPO are read from the first folder that has
them, and every folder must hold the same base records (same model, same test questions).

    python -m ncgrpo.toy.seed_table runs/T1 runs/T2 runs/T3
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.eval.records import EvalRecord
from ncgrpo.eval.report import load_run
from ncgrpo.eval.stats import align, mcnemar_pooled

__all__ = ["IN_DOMAIN", "OOD_FAMILIES", "POPE", "MethodRows", "load_runs", "main", "seed_table"]

IN_DOMAIN = "synthetic/geometry"
#: The out-of-domain families averaged in the "OOD avg" column (POPE has its own column).
OOD_FAMILIES = ("synthetic/counting", "synthetic/bar_chart", "synthetic/compare", "synthetic/colour_choice")
POPE = "synthetic/pope"
BASE_DIR, VANILLA_SLUG = "base", "grpo"
_SHORTCUT = re.compile(r"<think>answer:")


@dataclass
class MethodRows:
    """One configuration: its table name and its records per seed."""

    name: str
    seeds: dict[int, list[EvalRecord]] = field(default_factory=dict)


def load_runs(folders: Sequence[str | Path]) -> tuple[list[EvalRecord], dict[str, MethodRows]]:
    """(base records, {run slug: rows}) from demo ``--out`` folders, vanilla first."""
    base: list[EvalRecord] | None = None
    runs: dict[str, MethodRows] = {}
    for folder in map(Path, folders):
        eval_root = folder / "eval"
        if not eval_root.is_dir():
            raise ValueError(f"{folder}: no eval/ folder; pass the --out folder of an ncgrpo demo run")
        if (eval_root / BASE_DIR / "records.jsonl").is_file():
            here = load_run(eval_root / BASE_DIR).records
            if base is None:
                base = here
            elif sorted(r.outcome() for r in here) != sorted(r.outcome() for r in base):
                raise ValueError(f"{folder}: its base-model records differ from the first folder's")
        for d in sorted(eval_root.iterdir()):
            m = re.fullmatch(r"(.+)-seed(\d+)", d.name)
            if m is None or not (d / "records.jsonl").is_file():
                continue
            slug, seed = m.group(1), int(m.group(2))
            if slug in runs and seed in runs[slug].seeds:
                continue  # vanilla repeated in several folders: the first one counts
            run = load_run(d)
            rows = runs.setdefault(slug, MethodRows(re.sub(r" \(seed \d+\)$", "", run.name)))
            rows.seeds[seed] = run.records
    if base is None:
        raise ValueError("no base-model records (eval/base) in any folder")
    if VANILLA_SLUG not in runs:
        raise ValueError("no vanilla GRPO records (eval/grpo-seedN) in any folder")
    ordered = {VANILLA_SLUG: runs.pop(VANILLA_SLUG)}
    ordered.update(sorted(runs.items(), key=lambda kv: _row_order(kv[0])))
    return base, ordered


def _row_order(slug: str) -> tuple[bool, int, str]:
    """The paper's row order (NC-GRPO by scale, image, antithetic, SPSA, the first-token control), the
    propagating site's runs (``...-L1``) last."""
    prefixes = ("ncgrpo-", "image", "antithetic-", "spsa-", "first-token-")
    rank = next((i for i, p in enumerate(prefixes) if slug.startswith(p)), len(prefixes))
    return ("-L" in slug, rank, slug)


def _accuracy(records: Sequence[EvalRecord], benchmark: str) -> float:
    oks = [r.correct for r in records if r.benchmark == benchmark]
    if not oks:
        raise ValueError(f"no records of {benchmark}")
    return 100.0 * sum(oks) / len(oks)


def _shortcut(records: Sequence[EvalRecord]) -> float:
    rows = [r for r in records if r.benchmark == IN_DOMAIN]
    return 100.0 * sum(bool(_SHORTCUT.search(r.output)) for r in rows) / len(rows)


def _p(p: float) -> str:
    return "<1e-4" if p < 1e-4 else f"{p:.2g}"


def seed_table(folders: Sequence[str | Path]) -> str:
    """The Markdown table (see the module docstring) of the demo runs in ``folders``."""
    base, runs = load_runs(folders)
    vanilla = runs[VANILLA_SLUG].seeds
    per_seed = "(seed " + "/".join(map(str, sorted(vanilla))) + ")"
    lines = [
        f"| Method | in-domain % {per_seed} | p vs base {per_seed} | OOD avg % | POPE % | "
        f"pooled p vs vanilla (wins/losses) | differ from vanilla % {per_seed} | shortcut % |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    ood = sum(_accuracy(base, f) for f in OOD_FAMILIES) / len(OOD_FAMILIES)
    lines.append(
        f"| Base model | {_accuracy(base, IN_DOMAIN):.1f} | | {ood:.1f} | {_accuracy(base, POPE):.1f} | | | "
        f"{_shortcut(base):.0f} |"
    )
    for slug, rows in runs.items():
        seeds = sorted(rows.seeds)
        acc, vs_base, differ, pairs = [], [], [], []
        for s in seeds:
            recs = rows.seeds[s]
            acc.append(f"{_accuracy(recs, IN_DOMAIN):.1f}")
            vs_base.append(_p(align(recs, base, benchmark=IN_DOMAIN).test().p))
            if slug != VANILLA_SLUG:
                if s not in vanilla:
                    raise ValueError(f"{rows.name}: seed {s} has no vanilla GRPO run to pair with")
                paired = align(recs, vanilla[s], benchmark=IN_DOMAIN)
                differ.append(f"{100.0 * (paired.a != paired.b).mean():.1f}")
                pairs.append((paired.a, paired.b))
        if pairs:
            pooled = mcnemar_pooled(pairs)
            pooled_cell = f"{_p(pooled.p)} ({pooled.n10}/{pooled.n01})"
        else:
            pooled_cell = "—"
        ood = sum(_accuracy(rows.seeds[s], f) for s in seeds for f in OOD_FAMILIES) / (
            len(seeds) * len(OOD_FAMILIES)
        )
        pope = sum(_accuracy(rows.seeds[s], POPE) for s in seeds) / len(seeds)
        shortcut = sum(_shortcut(rows.seeds[s]) for s in seeds) / len(seeds)
        lines.append(
            f"| {rows.name} | {'/'.join(acc)} | {'/'.join(vs_base)} | {ood:.1f} | {pope:.1f} | {pooled_cell} | "
            f"{'/'.join(differ) or '—'} | {shortcut:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    try:
        sys.stdout.write(seed_table(args))
    except (ValueError, OSError) as e:
        print(f"ncgrpo.toy.seed_table: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
