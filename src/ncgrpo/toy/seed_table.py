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
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ncgrpo.eval.records import EvalRecord
from ncgrpo.eval.report import load_run
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
from ncgrpo.runs.folder import atomic_write_bytes, atomic_write_json, json_rows, read_run_json

__all__ = [
    "EXPORT_FORMAT",
    "MANIFEST_FILE",
    "IN_DOMAIN",
    "OOD_FAMILIES",
    "POPE",
    "MethodRows",
    "TableRecord",
    "export",
    "load_runs",
    "main",
    "seed_table",
]

IN_DOMAIN = "synthetic/geometry"
#: The out-of-domain families averaged in the "OOD avg" column (POPE has its own column).
OOD_FAMILIES = ("synthetic/counting", "synthetic/bar_chart", "synthetic/compare", "synthetic/colour_choice")
POPE = "synthetic/pope"
#: The benchmarks the table reads (and an export keeps).
TABLE_BENCHMARKS = (IN_DOMAIN, *OOD_FAMILIES, POPE)
BASE_DIR, VANILLA_SLUG = "base", "grpo"
_SHORTCUT = re.compile(r"<think>answer:")

#: First line of every export file; bump when the line format changes.
EXPORT_FORMAT = "ncgrpo.seed_table/1"
BASE_FILE = "base.jsonl.gz"
#: An export's record of what made it (see the module docstring), and its format line.
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "ncgrpo.seed_table.manifest/1"
_EXPORT_RUN = re.compile(r"(.+)-seed(\d+)\.jsonl\.gz")


@dataclass(frozen=True)
class TableRecord:
    """What the table reads of one question's record: its identity (benchmark and question_id, the
    pairing key, and the gold answer, checked against the base model's so runs on other test
    questions cannot pass for each other), whether the answer is correct, and whether it takes the
    shortcut. (Not the prompt_hash: it would double an export's size, and gold already tells two
    test splits apart.)"""

    benchmark: str
    question_id: str
    role: str
    gold: str
    correct: bool
    shortcut: bool

    @classmethod
    def of(cls, r: EvalRecord) -> TableRecord:
        return cls(r.benchmark, r.question_id, r.role, r.gold, r.correct, bool(_SHORTCUT.search(r.output)))


@dataclass
class MethodRows:
    """One configuration: its table name and its records per seed."""

    name: str
    seeds: dict[int, list[TableRecord]] = field(default_factory=dict)


#: What says which run produced a folder's records, beside the records: the evaluated model's id (a
#: hash of its weights' contents, ``ncgrpo.eval.evaluate.model_id_of``) and the decoding settings
#: (``ncgrpo.eval.report.conditions.run_conditions``). None where unknown: an export written before
#: these were kept, or a run.json without them; such runs are compared on their records alone.
Provenance = dict[str, Any]
# One run in a folder: (slug, seed, read it -> (name, records, provenance)); read only if the run is used.
_Entry = tuple[str, int, Callable[[], tuple[str, list[TableRecord], Provenance]]]


def _provenance(run: Any) -> Provenance:
    from ncgrpo.eval.report.conditions import run_conditions

    return {"model": run.info.get("model"), "decoding": run_conditions(run)}


def _demo_folder(
    folder: Path,
) -> tuple[Callable[[], tuple[list[TableRecord], Provenance]] | None, list[_Entry]]:
    eval_root = folder / "eval"
    base = None
    if (eval_root / BASE_DIR / "records.jsonl").is_file():

        def base() -> tuple[list[TableRecord], Provenance]:
            run = load_run(eval_root / BASE_DIR)
            return [TableRecord.of(r) for r in run.records], _provenance(run)

    entries: list[_Entry] = []
    for d in sorted(eval_root.iterdir()):
        m = re.fullmatch(r"(.+)-seed(\d+)", d.name)
        if m is None or not (d / "records.jsonl").is_file():
            continue

        def read(d: Path = d) -> tuple[str, list[TableRecord], Provenance]:
            run = load_run(d)
            name = re.sub(r" \(seed \d+\)$", "", run.name)
            return name, [TableRecord.of(r) for r in run.records], _provenance(run)

        entries.append((m.group(1), int(m.group(2)), read))
    return base, entries


def _export_folder(
    folder: Path,
) -> tuple[Callable[[], tuple[list[TableRecord], Provenance]] | None, list[_Entry]]:
    base = None
    if (folder / BASE_FILE).is_file():

        def base() -> tuple[list[TableRecord], Provenance]:
            return _read_export(folder / BASE_FILE, "base", None)[1:]

    entries: list[_Entry] = []
    for path in sorted(folder.iterdir()):
        m = _EXPORT_RUN.fullmatch(path.name)
        if m is None:
            continue
        slug, seed = m.group(1), int(m.group(2))
        entries.append((slug, seed, lambda path=path, slug=slug, seed=seed: _read_export(path, slug, seed)))
    return base, entries


def _is_export(folder: Path) -> bool:
    return folder.is_dir() and (
        (folder / BASE_FILE).is_file() or any(_EXPORT_RUN.fullmatch(p.name) for p in folder.iterdir())
    )


def load_runs(folders: Sequence[str | Path]) -> tuple[list[TableRecord], dict[str, MethodRows]]:
    """(base records, {run slug: rows}) from demo ``--out`` folders or ``--export`` folders, vanilla first.

    A run found in several folders (vanilla GRPO, shared by demos split with ``--rollout_methods``; the
    base model) must be the same run in each: the same model id (its weights' contents) and decoding
    where both folders record them, and the same records; and every run was decoded alike. Else an
    error names the difference and both folders."""
    return _load(folders)[:2]


def _load(
    folders: Sequence[str | Path],
) -> tuple[
    list[TableRecord],
    dict[str, MethodRows],
    dict[tuple[str, int | None], Provenance],
    dict[tuple[str, int | None], Path],
]:
    """:func:`load_runs`, each run's provenance by (slug, seed) (``("base", None)``: the base's), and
    the folder each run of the table was read from (the first that has it)."""
    base: list[TableRecord] | None = None
    runs: dict[str, MethodRows] = {}
    seen: dict[tuple[str, int | None], tuple[Path, list[TableRecord], Provenance]] = {}
    for folder in map(Path, folders):
        if (folder / "eval").is_dir():
            read_base, entries = _demo_folder(folder)
        elif _is_export(folder):
            read_base, entries = _export_folder(folder)
        else:
            raise ValueError(
                f"{folder}: no eval/ folder; pass the --output_dir folder of an ncgrpo demo run "
                "(or a folder written by --export)"
            )
        if read_base is not None:
            here, prov = read_base()
            _same_run(seen, ("base", None), "its base-model records differ", folder, here, prov)
            if base is None:
                base = here
        for slug, seed, read in entries:
            name, records, prov = read()
            # a run in several folders (vanilla, shared by demos split with --rollout_methods) must be
            # the same run in each: the first one counts
            if not _same_run(
                seen,
                (slug, seed),
                f"its {name} seed {seed} ({slug}-seed{seed}) differs",
                folder,
                records,
                prov,
            ):
                continue
            rows = runs.setdefault(slug, MethodRows(name))
            rows.seeds[seed] = records
    _same_decoding(seen)
    if base is None:
        raise ValueError("no base-model records (eval/base) in any folder")
    if VANILLA_SLUG not in runs:
        raise ValueError("no vanilla GRPO records (eval/grpo-seedN) in any folder")
    gold = {(r.benchmark, r.question_id): r.gold for r in base}
    for rows in runs.values():
        for seed, records in rows.seeds.items():
            for r in records:
                if (
                    r.benchmark in TABLE_BENCHMARKS
                    and gold.get((r.benchmark, r.question_id), r.gold) != r.gold
                ):
                    raise ValueError(
                        f"{rows.name} seed {seed}: question {r.benchmark}/{r.question_id} has gold {r.gold!r}, "
                        f"the base model's records {gold[r.benchmark, r.question_id]!r} (other test questions?)"
                    )
    ordered = {VANILLA_SLUG: runs.pop(VANILLA_SLUG)}
    ordered.update(sorted(runs.items(), key=lambda kv: _row_order(kv[0])))
    return (
        base,
        ordered,
        {key: prov for key, (_, _, prov) in seen.items()},
        {key: folder for key, (folder, _, _) in seen.items()},
    )


def _same_run(
    seen: dict[tuple[str, int | None], tuple[Path, list[TableRecord], Provenance]],
    key: tuple[str, int | None],
    what: str,
    folder: Path,
    records: list[TableRecord],
    prov: Provenance,
) -> bool:
    """True for the first folder with run ``key``; for a later one, check it is the same run (the same
    model and decoding where both folders say, the same records) and return False, else raise naming
    each difference and both folders."""
    first = seen.setdefault(key, (folder, records, prov))
    if first[0] == folder:
        return True
    was_folder, was_records, was_prov = first
    diffs = [
        f"{k} is {was_prov[k]!r} there, {prov[k]!r} here"
        for k in ("model", "decoding")
        if was_prov.get(k) is not None and prov.get(k) is not None and was_prov[k] != prov[k]
    ]
    if _base_key(records) != _base_key(was_records):
        n = len(set(_base_key(records)) ^ set(_base_key(was_records)))
        diffs.append(f"their records differ ({n} question outcome(s) differ between the two)")
    if diffs:
        raise ValueError(
            f"{folder}: {what} from the first folder's ({was_folder}): {'; '.join(diffs)}; the folders must "
            "share these runs (demos run with the same settings but --rollout_methods): pass folders of one "
            "experiment"
        )
    return False


def _same_decoding(seen: dict[tuple[str, int | None], tuple[Path, list[TableRecord], Provenance]]) -> None:
    """Every run of the table (base included) decoded under the same settings, where known."""
    known = [
        (key, folder, prov["decoding"]) for key, (folder, _, prov) in seen.items() if prov.get("decoding")
    ]
    for key, folder, decoding in known[1:]:
        if decoding != known[0][2]:
            k0, f0, d0 = known[0]
            diff = "; ".join(
                f"{k} is {d0.get(k)!r} for {k0[0]} in {f0}, {decoding.get(k)!r} for {key[0]} seed {key[1]} in {folder}"
                for k in dict.fromkeys([*d0, *decoding])
                if d0.get(k) != decoding.get(k)
            )
            raise ValueError(f"the runs were not evaluated under the same decoding settings: {diff}")


def _base_key(records: Sequence[TableRecord]) -> list[tuple[Any, ...]]:
    """What must agree between two folders' base records (the table's benchmarks only, so a demo
    folder and an export of it agree)."""
    return sorted(
        (r.benchmark, r.question_id, r.role, r.gold, r.correct, r.shortcut)
        for r in records
        if r.benchmark in TABLE_BENCHMARKS
    )


def _row_order(slug: str) -> tuple[bool, int, str]:
    """The paper's row order (NC-GRPO by scale, image, antithetic, SPSA, the first-token control, then
    its noise-averaged variant ``first-token-marginal``), the propagating site's runs (``...-L1``)
    last."""
    prefixes = ("ncgrpo-", "image", "antithetic-", "spsa-", "first-token-", "first-token-marginal")
    matching = [i for i, p in enumerate(prefixes) if slug.startswith(p)]
    rank = max(matching, key=lambda i: len(prefixes[i])) if matching else len(prefixes)  # longest prefix
    return ("-L" in slug, rank, slug)


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
    base, runs, _, where = _load(folders)
    return _table(base, runs, _runs_provenance(where))


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


# --- the committed form of the records ---------------------------------------------------------


def _export_bytes(header: dict[str, Any], records: Sequence[TableRecord]) -> bytes:
    """One gzip JSONL file: the header line, then one line per record of the table's benchmarks,
    sorted; gzip with mtime 0 and no file name, so the same records give the same bytes."""
    rows = sorted(
        (r for r in records if r.benchmark in TABLE_BENCHMARKS), key=lambda r: (r.benchmark, r.question_id)
    )
    lines = [{"format": EXPORT_FORMAT, **header}] + [asdict(r) for r in rows]
    text = "".join(
        json.dumps(x, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n" for x in lines
    )
    return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)


def _read_export(path: Path, slug: str, seed: int | None) -> tuple[str, list[TableRecord], Provenance]:
    """(name, records, provenance) of one export file; errors name the file and line. The header's
    ``model`` and ``decoding`` are the provenance; an export written before they were kept has
    neither (None: its runs are compared on their records alone)."""
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a gzip file ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = list(json_rows(enumerate(text.splitlines(), start=1), path, "line"))
    if not rows or rows[0][1].get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}:1: not a seed-table export (first line must say format {EXPORT_FORMAT!r})")
    header = rows[0][1]
    if header.get("slug") != slug or header.get("seed") != seed:
        raise ValueError(
            f"{path}:1: header says run {header.get('slug')!r} seed {header.get('seed')!r}, "
            f"the file name {slug!r} seed {seed!r}"
        )
    name = header.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{path}:1: header has no run name")
    fields = TableRecord.__dataclass_fields__
    records = []
    for i, row in rows[1:]:
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"{path}:{i}: missing field(s) {missing}")
        for f in ("correct", "shortcut"):
            if not isinstance(row[f], bool):
                raise ValueError(f"{path}:{i}: field {f!r} must be true/false, got {row[f]!r}")
        records.append(TableRecord(**{f: row[f] for f in fields}))
    if not records:
        raise ValueError(f"{path}: no records")
    return name, records, {"model": header.get("model"), "decoding": header.get("decoding")}


def export(
    folders: Sequence[str | Path], dest: str | Path, *, command: str | None = None
) -> tuple[list[Path], list[Path]]:
    """Write the records the table of ``folders`` needs into ``dest`` (``base.jsonl.gz`` and one
    ``<slug>-seed<N>.jsonl.gz`` per run) and ``dest/manifest.json`` (:func:`manifest`; ``command``:
    the command line that exported them, where known); remove export files in ``dest`` of runs not
    written now, so a stale run cannot stay in the table. Returns (written, removed).

    Raises if the table read back from ``dest`` is not the table of ``folders`` (a bug, not bad input).
    """
    base, runs, provenance, where = _load(folders)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"--export {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)

    def known(key: tuple[str, int | None]) -> dict[str, Any]:  # the provenance the folders recorded
        return {k: v for k, v in provenance.get(key, {}).items() if v is not None}

    header = {"slug": "base", "seed": None, "name": "Base model", **known(("base", None))}
    files = {BASE_FILE: _export_bytes(header, base)}
    for slug, rows in runs.items():
        for seed in sorted(rows.seeds):
            header = {"slug": slug, "seed": seed, "name": rows.name, **known((slug, seed))}
            files[f"{slug}-seed{seed}.jsonl.gz"] = _export_bytes(header, rows.seeds[seed])
    for name, data in files.items():
        atomic_write_bytes(dest / name, data)
    stale = sorted(
        p
        for p in dest.iterdir()
        if (p.name == BASE_FILE or _EXPORT_RUN.fullmatch(p.name)) and p.name not in files
    )
    for p in stale:
        p.unlink()
    made = _runs_provenance(where)
    atomic_write_json(dest / MANIFEST_FILE, manifest(folders, made, command))
    if seed_table([dest]) != _table(base, runs, made):
        raise RuntimeError(f"{dest}: the exported records do not give the folders' table")
    return [dest / n for n in [*files, MANIFEST_FILE]], stale


# --- what made the records ---------------------------------------------------------------------


def _run_key(slug: str, seed: int | None) -> str:
    return BASE_DIR if seed is None else f"{slug}-seed{seed}"


def _folder_provenance(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run folder's ``provenance`` and ``provenance_history`` (None: its run.json records neither)."""
    kept = {k: (info or {}).get(k) for k in ("provenance", "provenance_history")}
    kept = {k: v for k, v in kept.items() if v}
    return kept or None


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """An export's ``manifest.json`` (None: exported before manifests were written); errors name it."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a seed-table manifest (its format must be {MANIFEST_FORMAT!r})")
    if not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path}: 'runs' must be an object (run -> its provenance)")
    return data


def _runs_provenance(where: dict[tuple[str, int | None], Path]) -> dict[str, dict[str, Any] | None]:
    """``{run: {"train": ..., "eval": ...} or None}`` for each run of the table (``base``,
    ``<slug>-seed<N>``), read where the table read it: a demo folder's ``eval/<run>/run.json`` and
    ``train/<run>/run.json`` (:func:`_folder_provenance`; None for a folder whose run.json records
    none), an export's manifest (None where it has none)."""
    out: dict[str, dict[str, Any] | None] = {}
    manifests: dict[Path, dict[str, Any] | None] = {}
    for (slug, seed), folder in sorted(
        where.items(), key=lambda kv: (kv[0][1] is not None, kv[0][0], kv[0][1] or 0)
    ):
        run = _run_key(slug, seed)
        if (folder / "eval").is_dir():
            parts = {
                kind: _folder_provenance(read_run_json(folder / kind / run, hint="move it away or fix it"))
                for kind in ("train", "eval")
                if (folder / kind / run).is_dir()
            }
            out[run] = parts or None  # a part None: that run.json records no provenance
        else:
            if folder not in manifests:
                manifests[folder] = _read_manifest(folder)
            found = (manifests[folder] or {}).get("runs", {}).get(run)
            out[run] = found if isinstance(found, dict) and found else None
    return out


def manifest(
    folders: Sequence[str | Path], runs: dict[str, dict[str, Any] | None], command: str | None
) -> dict[str, Any]:
    """``manifest.json`` of an export: its format, the command line, the folders read, what made the
    export (this process's :func:`ncgrpo.runs.provenance.provenance`: commit, dirty, package versions)
    and ``runs``: each run's own provenance (``{"train": {"provenance", "provenance_history"}, "eval":
    {...}}``; None where its run.json records none). No time stamp: the same export gives the same bytes."""
    from ncgrpo.runs.provenance import provenance

    return {
        "format": MANIFEST_FORMAT,
        "command": command,
        "folders": [str(f) for f in folders],
        **provenance(),
        "runs": runs,
    }


def _made(p: dict[str, Any]) -> str:
    commit = str(p.get("commit"))[:12] if p.get("commit") else "unknown"
    tree = {True: f" with uncommitted changes ({p.get('dirty_digest')})", False: ""}.get(p.get("dirty"), "")
    return f"{commit}{tree}"


def made_by(runs: dict[str, dict[str, Any] | None]) -> str:
    """One line under the table: the commit(s) that made the runs' records (training and evaluation,
    a resume's or an append's too) and their package versions, as the runs' run.json recorded them.
    A run is counted as unknown in part when its training or its evaluation recorded no provenance, or
    only for a later resume or append (what made its first part is unknown)."""
    commits: dict[str, None] = {}
    versions: dict[str, dict[str, None]] = {}
    unknown = 0
    for entry in runs.values():
        provs = []
        parts = list((entry or {}).values()) or [None]
        for part in parts:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("provenance"), dict):
                provs.append(part["provenance"])
            provs += [
                h["provenance"]
                for h in part.get("provenance_history") or []
                if isinstance(h, dict) and isinstance(h.get("provenance"), dict)
            ]
        if any(not isinstance(part, dict) or not isinstance(part.get("provenance"), dict) for part in parts):
            unknown += 1
        for p in provs:
            commits[_made(p)] = None
            for k, v in (p.get("versions") or {}).items():
                if v is not None:
                    versions.setdefault(k, {})[v] = None
    if not commits:
        return (
            "Made by: unknown (no commit or package versions recorded: the runs predate run.json's "
            f"provenance, or the export has no {MANIFEST_FILE})."
        )
    names = {"trl": "TRL"}
    text = f"Made by: ncgrpo commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}"
    if versions:
        text += "; " + ", ".join(f"{names.get(k, k)} {'/'.join(v)}" for k, v in versions.items())
    if unknown:
        text += (
            f"; unknown in part for {unknown} of {len(runs)} runs (a training or evaluation run.json "
            "without provenance)"
        )
    return text + "."


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
            import shlex

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
