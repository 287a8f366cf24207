"""What the seed table reads, and where from: one question's :class:`TableRecord`, a configuration's
records per seed (:class:`MethodRows`), the compact export file form (one gzip JSONL per run), and
:func:`load_runs`, which reads demo ``--out`` folders and ``--export`` folders and checks that a run
found in several of them is the same run, that every run was decoded alike and asked the same
questions, and orders the rows as the paper does (from the method registry). The table itself, the
export command and the CLI: :mod:`ncgrpo.toy.seed_table`.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ncgrpo.eval.records import EvalRecord
from ncgrpo.eval.report import load_run
from ncgrpo.eval.report.conditions import run_conditions
from ncgrpo.methods import methods
from ncgrpo.runs.folder import json_rows

__all__ = [
    "BASE_DIR",
    "BASE_FILE",
    "EXPORT_FORMAT",
    "IN_DOMAIN",
    "OOD_FAMILIES",
    "POPE",
    "TABLE_BENCHMARKS",
    "VANILLA_SLUG",
    "MethodRows",
    "Provenance",
    "TableRecord",
    "export_bytes",
    "is_export_file",
    "load_runs",
    "load_runs_where",
    "read_export",
    "row_order",
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
            return read_export(folder / BASE_FILE, "base", None)[1:]

    entries: list[_Entry] = []
    for path in sorted(folder.iterdir()):
        m = _EXPORT_RUN.fullmatch(path.name)
        if m is None:
            continue
        slug, seed = m.group(1), int(m.group(2))
        entries.append((slug, seed, lambda path=path, slug=slug, seed=seed: read_export(path, slug, seed)))
    return base, entries


def is_export_file(name: str) -> bool:
    """``name`` is one of an export's record files (``base.jsonl.gz``, ``<slug>-seed<N>.jsonl.gz``)."""
    return name == BASE_FILE or _EXPORT_RUN.fullmatch(name) is not None


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
    return load_runs_where(folders)[:2]


def load_runs_where(
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
    ordered.update(sorted(runs.items(), key=lambda kv: row_order(kv[0])))
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


def row_order(slug: str) -> tuple[bool, int, str]:
    """The paper's row order: the registered methods' runs in registration order (NC-GRPO by scale,
    image, antithetic, SPSA, the first-token control, then its noise-averaged variant
    ``first-token-marginal``; :func:`ncgrpo.methods.methods`), then runs of no registered method, the
    propagating site's runs (``...-L1``) last. A run belongs to the method whose folder stem (its
    ``slug``, as :meth:`~ncgrpo.methods.base.RolloutMethod.demo_run` names it) is the run's slug or
    begins it followed by ``-``; the longest such stem wins (``first-token-marginal-sigma1`` is
    first-token-marginal's, not first-token's)."""
    stems = _method_stems()
    matching = [i for i, stem in enumerate(stems) if slug == stem or slug.startswith(stem + "-")]
    rank = max(matching, key=lambda i: len(stems[i])) if matching else len(stems)  # longest stem
    return ("-L" in slug, rank, slug)


def _method_stems() -> list[str]:
    """Each registered method's run-folder stem, in registration order (the baseline's too: it is
    ordered first by the table anyway)."""
    return [m.slug or m.name.replace("_", "-") for m in methods()]


# --- the committed form of the records ---------------------------------------------------------


def export_bytes(header: dict[str, Any], records: Sequence[TableRecord]) -> bytes:
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


def read_export(path: Path, slug: str, seed: int | None) -> tuple[str, list[TableRecord], Provenance]:
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
