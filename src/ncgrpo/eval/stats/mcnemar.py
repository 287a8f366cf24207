"""The paper's question-level statistics: exact McNemar tests, pairing two runs' records per question,
summaries (macro accuracy, mean +- half-range) and family-wise corrections (see :mod:`ncgrpo.eval.stats`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

#: Significance level of the paper's tests (and of :func:`disagreement_note`).
ALPHA = 0.05


class RecordLike(Protocol):
    benchmark: str
    question_id: str
    correct: bool


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test of method ``a`` against baseline ``b`` on ``n`` paired questions.

    Discordant counts are indexed (a, b): ``n10`` = method right and baseline wrong (the method's
    wins), ``n01`` = method wrong and baseline right (its losses). ``acc_a``/``acc_b`` are fractions
    in [0, 1]; ``diff_pp`` is ``acc_a - acc_b`` in percentage points.
    """

    n: int
    n01: int
    n10: int
    p: float
    acc_a: float
    acc_b: float
    diff_pp: float

    @property
    def discordant(self) -> int:
        return self.n01 + self.n10

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_bool(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != bool:
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold booleans (or 0/1)")
        arr = arr.astype(bool)
    return arr


def mcnemar_exact(a: Any, b: Any) -> McNemarResult:
    """Two-sided exact McNemar test: binomial test of ``n10`` out of ``n01 + n10`` at p = 1/2.

    ``a`` (method) and ``b`` (baseline) are paired boolean arrays (``a[i]``, ``b[i]``: the same
    question). With no discordant pair there is no evidence either way and ``p = 1``.
    """
    a = _as_bool(a, "a")
    b = _as_bool(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired arrays differ in length: {a.size} vs {b.size}")
    n = int(a.size)
    if n == 0:
        raise ValueError("mcnemar_exact needs at least one paired question")
    from scipy.stats import binomtest  # slow to import (~1-2 s); only when a test is run

    n10 = int(np.count_nonzero(a & ~b))
    n01 = int(np.count_nonzero(~a & b))
    p = 1.0 if n01 + n10 == 0 else float(binomtest(n10, n01 + n10, 0.5).pvalue)
    acc_a = float(a.mean())
    acc_b = float(b.mean())
    return McNemarResult(
        n=n, n01=n01, n10=n10, p=min(p, 1.0), acc_a=acc_a, acc_b=acc_b, diff_pp=100.0 * (n10 - n01) / n
    )


def mcnemar_pooled(pairs: Iterable[tuple[Any, Any]]) -> McNemarResult:
    """One exact McNemar test on the concatenation of several paired (a, b) arrays."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("mcnemar_pooled needs at least one (a, b) pair of arrays")
    a = np.concatenate([_as_bool(x, "a") for x, _ in pairs])
    b = np.concatenate([_as_bool(y, "b") for _, y in pairs])
    return mcnemar_exact(a, b)


# --- pairing records -------------------------------------------------------------------------


class AlignmentError(ValueError):
    """Two runs do not cover the same questions, so they cannot be compared per question."""


@dataclass(frozen=True)
class Paired:
    """Outcomes of two runs on the same questions, in ``keys`` order (sorted)."""

    keys: list[tuple[str, str]]  # (benchmark, question_id)
    a: np.ndarray  # [n] bool, method correct
    b: np.ndarray  # [n] bool, baseline correct

    def test(self) -> McNemarResult:
        return mcnemar_exact(self.a, self.b)


def _outcomes(records: Iterable[RecordLike], benchmark: str | None, side: str) -> dict[tuple[str, str], bool]:
    out: dict[tuple[str, str], bool] = {}
    for r in records:
        if benchmark is not None and r.benchmark != benchmark:
            continue
        key = (r.benchmark, str(r.question_id))
        if key in out and out[key] != bool(r.correct):
            raise AlignmentError(
                f"run {side}: question {key[0]}/{key[1]} appears twice with different outcomes"
            )
        out[key] = bool(r.correct)
    return out


def _asked(
    records: Iterable[RecordLike], benchmark: str | None
) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(benchmark, question_id) -> (prompt_hash, gold, image_hash) as recorded ("" where a record has
    none: image_hash in records written before it existed, or for a question without images)."""
    return {
        (r.benchmark, str(r.question_id)): (
            str(getattr(r, "prompt_hash", "") or ""),
            str(getattr(r, "gold", "") or ""),
            str(getattr(r, "image_hash", "") or ""),
        )
        for r in records
        if benchmark is None or r.benchmark == benchmark
    }


def _check_same_questions(
    records_a: Iterable[RecordLike], records_b: Iterable[RecordLike], benchmark: str | None
) -> None:
    qa, qb = _asked(records_a, benchmark), _asked(records_b, benchmark)
    for key in sorted(qa.keys() & qb.keys()):
        (ha, ga, ia), (hb, gb, ib) = qa[key], qb[key]
        what = []
        if ha and hb and ha != hb:
            what.append(f"prompt_hash {ha} vs {hb}")
        if ga and gb and ga != gb:
            what.append(f"gold {ga!r} vs {gb!r}")
        if ia and ib and ia != ib:
            what.append(f"image pixels (image_hash) {ia} vs {ib}")
        if what:
            raise AlignmentError(
                f"question {key[0]}/{key[1]} is not the same question in the two runs ({'; '.join(what)}): "
                "they were evaluated on different question sets that reuse ids (e.g. a suite built with "
                "another seed, or a figure changed under the same text); compare runs evaluated on the same data"
            )


def _name_some(keys: set[tuple[str, str]], limit: int = 5) -> str:
    shown = ", ".join(f"{bm}/{qid}" for bm, qid in sorted(keys)[:limit])
    more = len(keys) - limit
    return shown + (f", ... ({more} more)" if more > 0 else "")


def align(
    records_a: Iterable[RecordLike], records_b: Iterable[RecordLike], *, benchmark: str | None = None
) -> Paired:
    """Pair two runs' records by ``(benchmark, question_id)`` (restricted to ``benchmark`` if given).

    Raises :class:`AlignmentError` naming some missing ids on each side, with counts, when the two
    runs did not answer the same questions (e.g. an unfinished evaluation): a paired test on the
    intersection would silently compare different question sets across configurations. Also when a
    shared ``(benchmark, question_id)`` was not the same question in the two runs: records that carry
    a ``prompt_hash``, a ``gold`` answer or an ``image_hash`` (the figures' pixels; both non-empty) must
    agree on them, else the error names the first such id (e.g. suites generated with two seeds reuse
    ids for other questions; a figure redrawn under the same text and gold).
    """
    records_a, records_b = list(records_a), list(records_b)
    oa = _outcomes(records_a, benchmark, "a")
    ob = _outcomes(records_b, benchmark, "b")
    only_a = oa.keys() - ob.keys()
    only_b = ob.keys() - oa.keys()
    scope = f" on benchmark {benchmark!r}" if benchmark is not None else ""
    if not oa and not ob:
        raise AlignmentError(f"no records{scope} in either run")
    if only_a or only_b:
        parts = [f"runs do not cover the same questions{scope} ({len(oa)} vs {len(ob)} questions)"]
        if only_b:
            parts.append(f"missing from run a: {len(only_b)} ({_name_some(only_b)})")
        if only_a:
            parts.append(f"missing from run b: {len(only_a)} ({_name_some(only_a)})")
        raise AlignmentError("; ".join(parts))
    keys = sorted(oa)
    _check_same_questions(records_a, records_b, benchmark)
    return Paired(
        keys=keys,
        a=np.array([oa[k] for k in keys], dtype=bool),
        b=np.array([ob[k] for k in keys], dtype=bool),
    )


def per_benchmark(
    records_a: Sequence[RecordLike], records_b: Sequence[RecordLike], benchmarks: Iterable[str] | None = None
) -> dict[str, McNemarResult]:
    """One exact McNemar test per benchmark (default: every benchmark either run has)."""
    if benchmarks is None:
        benchmarks = sorted({r.benchmark for r in records_a} | {r.benchmark for r in records_b})
    return {bm: align(records_a, records_b, benchmark=bm).test() for bm in benchmarks}


def pooled(
    records_a: Sequence[RecordLike], records_b: Sequence[RecordLike], benchmarks: Iterable[str]
) -> McNemarResult:
    """One test on the concatenated paired outcomes of all questions of ``benchmarks``."""
    return pooled_over_seeds([(records_a, records_b)], benchmarks)


def pooled_over_seeds(
    seed_pairs: Sequence[tuple[Sequence[RecordLike], Sequence[RecordLike]]], benchmarks: Iterable[str]
) -> McNemarResult:
    """One test on the pairs of every (method seed i, baseline seed i) run pair and benchmark.

    Each question contributes once per seed pair: two seeds of 10,671 OOD questions (HallusionBench's full
    image split) give the paper's n = 21,342, while its single-seed n = 10,038 is the deduplicated
    ``image_paper`` split (docs/benchmarks-data.md, "Counts").
    """
    return mcnemar_pooled(align_seeds(seed_pairs, benchmarks))


def align_seeds(
    seed_pairs: Sequence[tuple[Sequence[RecordLike], Sequence[RecordLike]]], benchmarks: Iterable[str]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per (method seed i, baseline seed i) run pair: the paired outcomes (a, b) on the questions of
    ``benchmarks``, concatenated in benchmark order (each aligned with :func:`align`).

    The input of the seed-level tests, which need the pairs of each seed apart; concatenating the
    returned pairs is what :func:`pooled_over_seeds` tests.
    """
    benchmarks = list(benchmarks)
    if not benchmarks:
        raise ValueError("pooled test needs at least one benchmark")
    out = []
    for ra, rb in seed_pairs:
        paired = [align(ra, rb, benchmark=bm) for bm in benchmarks]
        out.append((np.concatenate([p.a for p in paired]), np.concatenate([p.b for p in paired])))
    return out


# --- summaries and corrections ---------------------------------------------------------------


def macro_accuracy(accuracies: Mapping[str, float] | Iterable[float]) -> float:
    """Unweighted mean of per-benchmark accuracies (the tables' "OOD avg")."""
    vals = list(accuracies.values()) if isinstance(accuracies, Mapping) else list(accuracies)
    if not vals:
        raise ValueError("macro_accuracy of no benchmarks")
    return float(np.mean(vals))


def mean_half_range(values: Iterable[float]) -> tuple[float, float]:
    """Mean and half-range ``(max - min) / 2`` over seeds (the paper's "mean ± half-range, N=2")."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        raise ValueError("mean_half_range of no values")
    return float(v.mean()), float((v.max() - v.min()) / 2)


def _pvals(pvalues: Iterable[float]) -> np.ndarray:
    p = np.asarray(list(pvalues), dtype=float)
    if p.ndim != 1 or ((p < 0) | (p > 1) | np.isnan(p)).any():
        raise ValueError("p-values must be a flat list of numbers in [0, 1]")
    return p


def bonferroni(pvalues: Iterable[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Bonferroni over a family of m tests: adjusted ``min(1, m p)``; reject where adjusted < alpha."""
    p = _pvals(pvalues)
    adj = np.minimum(1.0, p * p.size)
    return adj, adj < alpha


def holm(pvalues: Iterable[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down correction (Holm 1979), in the input order.

    Sort p ascending; the i-th smallest (i = 0..m-1) gets ``(m - i) p_(i)``, made monotone with a
    running max and capped at 1. Rejecting where the adjusted value is < alpha is the step-down
    rule "reject p_(i) while p_(i) < alpha / (m - i), stop at the first failure".
    """
    p = _pvals(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adj = np.empty(m)
    adj[order] = np.minimum(1.0, stepped)
    return adj, adj < alpha
