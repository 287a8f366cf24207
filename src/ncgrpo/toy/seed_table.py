"""The README's several-seed table of ``ncgrpo demo`` runs, read from their per-question records.

``ncgrpo demo --seeds 3`` prints the paper's tables (per family and pooled OOD, against vanilla). This
module adds the view a toy needs to be read honestly: each seed's in-domain accuracy and its exact
McNemar test against the untrained base model (did GRPO learn at all?), the share of in-domain
questions whose outcome differs from vanilla's in the same seed (did the method change anything?),
one question-level McNemar test pooled over the seeds against vanilla, the seed-level test against
vanilla (a paired t-test over training seeds of the in-domain accuracy difference, the seeds being
the unit of replication; ``ncgrpo.eval.stats.seed_ttest``) with what that test could detect
(``ncgrpo.eval.stats.seed_power``: the minimum detectable difference at 80% power and alpha 0.05 given
the seeds' observed spread, and the seeds the observed mean difference would need; a row with one
seed gets a note instead: no seed-level claim), and the share of greedy answers that
take the warm-up's image-blind shortcut (:func:`ncgrpo.toy.traces.shortcut_trace`). A "Vanilla
seed-to-seed" row gives what two vanilla seeds already differ by, the reference for the "differ from
vanilla" column; a note under the table names each row whose question-level and seed-level tests
disagree at p < 0.05.

Several demo folders may be given (e.g. one per process, split with ``--rollout_methods``): rows are
keyed by run folder name, the base model and vanilla GRPO are read from the first folder that has
them, and every folder must hold the same base records (same model, same test questions).

    python -m ncgrpo.toy.seed_table runs/T1 runs/T2 runs/T3

The records behind a published table are kept in a compact form (one gzip JSONL per run: the
fields the table reads, deterministic bytes), from which the same table is printed:

    python -m ncgrpo.toy.seed_table --export docs/records/seed-table runs/T1 runs/T2 runs/T3
    python -m ncgrpo.toy.seed_table docs/records/seed-table

``--export`` writes the files atomically, removes export files of runs no longer given, writes
``DEST/manifest.json`` (:data:`MANIFEST_FILE`: the command line, the exporting ncgrpo's commit, whether
its source was dirty and its package versions, and each run's own ``provenance`` and
``provenance_history`` where its run.json has them: :mod:`ncgrpo.runs.provenance`), and prints the table
read back from DEST (the wrote-message goes to stderr).

Under the table (and its notes) one line says what made the records: the commit(s) and package versions
the runs' run.json recorded (read from the demo folders, or from an export's manifest), or that they are
unknown (runs from before provenance was recorded, an export without a manifest).

This module holds the table (its statistics and Markdown), :func:`export` and the command line; what
the table reads and where from (records, the export file form, folder loading and its checks, row
order): :mod:`ncgrpo.toy.seed_runs`; what made the records (manifest, the "Made by" line):
:mod:`ncgrpo.toy.seed_provenance`.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncgrpo.eval.stats import (
    MDD_LABEL,
    SEEDS_NEEDED_LABEL,
    align,
    disagreement_note,
    mcnemar_pooled,
    seed_power,
    seed_to_seed,
    seed_ttest,
)
from ncgrpo.runs.folder import atomic_write_bytes, atomic_write_json
from ncgrpo.toy.seed_provenance import MANIFEST_FILE, made_by, manifest, runs_provenance
from ncgrpo.toy.seed_runs import (
    BASE_FILE,
    EXPORT_FORMAT,
    IN_DOMAIN,
    OOD_FAMILIES,
    POPE,
    VANILLA_SLUG,
    MethodRows,
    TableRecord,
    export_bytes,
    is_export_file,
    load_runs,
    load_runs_where,
)

__all__ = [
    "EXPORT_FORMAT",
    "MANIFEST_FILE",
    "IN_DOMAIN",
    "OOD_FAMILIES",
    "POPE",
    "VANILLA_SLUG",
    "MethodRows",
    "TableRecord",
    "export",
    "load_runs",
    "main",
    "seed_table",
]


def _accuracy(records: Sequence[TableRecord], benchmark: str) -> float:
    oks = [r.correct for r in records if r.benchmark == benchmark]
    if not oks:
        raise ValueError(f"no records of {benchmark}")
    return 100.0 * sum(oks) / len(oks)


def _shortcut(records: Sequence[TableRecord]) -> float:
    rows = [r for r in records if r.benchmark == IN_DOMAIN]
    return 100.0 * sum(r.shortcut for r in rows) / len(rows)


def _p(p: float) -> str:
    if p != p:  # nan: the seed-level t-test is undefined (one seed, or no spread)
        return "n/a"
    return "<1e-4" if p < 1e-4 else f"{p:.2g}"


def seed_table(folders: Sequence[str | Path]) -> str:
    """The Markdown table (see the module docstring) of the demo runs in ``folders``, then one note
    line per row whose question-level and seed-level tests disagree, then what made the records
    (:func:`made_by`)."""
    base, runs, _, where = load_runs_where(folders)
    return _table(base, runs, runs_provenance(where))


def _table(
    base: list[TableRecord], runs: dict[str, MethodRows], made: dict[str, dict[str, Any] | None]
) -> str:
    """The table and its notes (:func:`_render`), a blank line, and what made the records (:func:`made_by`)."""
    return _render(base, runs) + "\n" + made_by(made) + "\n"


def _render(base: list[TableRecord], runs: dict[str, MethodRows]) -> str:
    vanilla = runs[VANILLA_SLUG].seeds
    per_seed = "(seed " + "/".join(map(str, sorted(vanilla))) + ")"
    lines = [
        f"| Method | in-domain % {per_seed} | p vs base {per_seed} | OOD avg % | POPE % | "
        "question-level pooled p vs vanilla (wins/losses) | seed-level p vs vanilla (mean diff, pts) | "
        f"{MDD_LABEL} | {SEEDS_NEEDED_LABEL} | differ from vanilla % {per_seed} | shortcut % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    ood = sum(_accuracy(base, f) for f in OOD_FAMILIES) / len(OOD_FAMILIES)
    lines.append(
        f"| Base model | {_accuracy(base, IN_DOMAIN):.1f} | | {ood:.1f} | {_accuracy(base, POPE):.1f} | | | | | | "
        f"{_shortcut(base):.0f} |"
    )
    notes = []
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
            seed_level = seed_ttest(pairs)
            seed_cell = f"{_p(seed_level.p)} ({seed_level.mean_pp:+.1f})"
            power = seed_power(seed_level)  # with one seed: n/a, and a note that says what it would need
            mdd_cell, need_cell = power.mdd_text, power.seeds_needed_text
            note = disagreement_note(pooled.p, seed_level.p, n_seeds=len(pairs), label=rows.name)
            for n in (note, power.note(rows.name)):
                if n:
                    notes.append(n)
        else:
            pooled_cell = seed_cell = mdd_cell = need_cell = "—"
        ood = sum(_accuracy(rows.seeds[s], f) for s in seeds for f in OOD_FAMILIES) / (
            len(seeds) * len(OOD_FAMILIES)
        )
        pope = sum(_accuracy(rows.seeds[s], POPE) for s in seeds) / len(seeds)
        shortcut = sum(_shortcut(rows.seeds[s]) for s in seeds) / len(seeds)
        lines.append(
            f"| {rows.name} | {'/'.join(acc)} | {'/'.join(vs_base)} | {ood:.1f} | {pope:.1f} | {pooled_cell} | "
            f"{seed_cell} | {mdd_cell} | {need_cell} | {'/'.join(differ) or '—'} | {shortcut:.0f} |"
        )
        if slug == VANILLA_SLUG and len(seeds) > 1:
            lines.append(_seed_to_seed_row(rows))
    out = "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "".join(f"- {n}\n" for n in notes)
    return out


def _seed_to_seed_row(vanilla: MethodRows) -> str:
    """How often two consecutive vanilla seeds differ on the in-domain questions (as "differ from
    vanilla"), and their question-level McNemar pooled over those pairs (wins = the earlier seed
    right, the later wrong)."""
    seeds = sorted(vanilla.seeds)
    first = vanilla.seeds[seeds[0]]
    outcomes = {s: align(vanilla.seeds[s], first, benchmark=IN_DOMAIN).a for s in seeds}
    null = seed_to_seed(outcomes, pairs=list(zip(seeds[:-1], seeds[1:], strict=True)))
    differ = "/".join(f"{100.0 * d:.1f}" for d in null.differ)
    label = "/".join(f"{i}-{j}" for i, j in null.pairs)
    q = null.pooled
    return (
        f"| Vanilla seed-to-seed (seeds {label}) | | | | | {_p(q.p)} ({q.n10}/{q.n01}) | | | | {differ} | |"
    )


def export(
    folders: Sequence[str | Path], dest: str | Path, *, command: str | None = None
) -> tuple[list[Path], list[Path]]:
    """Write the records the table of ``folders`` needs into ``dest`` (``base.jsonl.gz`` and one
    ``<slug>-seed<N>.jsonl.gz`` per run) and ``dest/manifest.json`` (:func:`manifest`; ``command``:
    the command line that exported them, where known); remove export files in ``dest`` of runs not
    written now, so a stale run cannot stay in the table. Returns (written, removed).

    Raises if the table read back from ``dest`` is not the table of ``folders`` (a bug, not bad input).
    """
    base, runs, provenance, where = load_runs_where(folders)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"--export {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)

    def known(key: tuple[str, int | None]) -> dict[str, Any]:  # the provenance the folders recorded
        return {k: v for k, v in provenance.get(key, {}).items() if v is not None}

    header = {"slug": "base", "seed": None, "name": "Base model", **known(("base", None))}
    files = {BASE_FILE: export_bytes(header, base)}
    for slug, rows in runs.items():
        for seed in sorted(rows.seeds):
            header = {"slug": slug, "seed": seed, "name": rows.name, **known((slug, seed))}
            files[f"{slug}-seed{seed}.jsonl.gz"] = export_bytes(header, rows.seeds[seed])
    for name, data in files.items():
        atomic_write_bytes(dest / name, data)
    stale = sorted(p for p in dest.iterdir() if is_export_file(p.name) and p.name not in files)
    for p in stale:
        p.unlink()
    made = runs_provenance(where)
    atomic_write_json(dest / MANIFEST_FILE, manifest(folders, made, command))
    if seed_table([dest]) != _table(base, runs, made):
        raise RuntimeError(f"{dest}: the exported records do not give the folders' table")
    return [dest / n for n in [*files, MANIFEST_FILE]], stale


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    try:
        if args[0] == "--export":
            if len(args) < 3:
                print(
                    "ncgrpo.toy.seed_table: error: --export needs DEST and at least one FOLDER",
                    file=sys.stderr,
                )
                return 2

            command = shlex.join(["python", "-m", "ncgrpo.toy.seed_table", *args])
            written, removed = export(args[2:], args[1], command=command)
            gone = f"; removed {', '.join(p.name for p in removed)}" if removed else ""
            print(f"wrote {len(written)} files to {args[1]}{gone}", file=sys.stderr)
            sys.stdout.write(seed_table([args[1]]))
        else:
            sys.stdout.write(seed_table(args))
    except (ValueError, OSError) as e:
        print(f"ncgrpo.toy.seed_table: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
