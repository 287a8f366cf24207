"""Whether evaluation runs may share a table: the same benchmark data and decoding conditions.

A comparison reads accuracy differences as the effect of training; two runs decoded with another
answer budget (``max_new_tokens``), graded by another grader, decoded by another engine, or asked
other questions under the same ids differ for reasons that are not training. :func:`check_comparable`
refuses such runs naming each differing field, its values and the folders that have them; the fields
of :data:`MAY_DIFFER` may be allowed explicitly (``ncgrpo compare --allow_different FIELD``), and the
difference is then returned for the table's header. Other benchmark data is never allowed: a paired
test needs the same questions, and :func:`check_same_questions` checks them across all runs, also
those no test pairs.

What a run's conditions are is read from its records (each carries the decoding settings it was
made with); fields that records written before them lack take their value then
(:data:`ncgrpo.eval.records.LEGACY_DECODING`), and a record with no decoding at all reads its
run.json's ``decoding`` and ``engine``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from ncgrpo.eval.records import LEGACY_DECODING, record_producer
from ncgrpo.eval.report.runs import Run
from ncgrpo.eval.stats import AlignmentError
from ncgrpo.eval.stats.mcnemar import _check_same_questions

#: The decoding fields compared between runs (run.json ``decoding`` plus ``engine``).
COMPARED = ("max_new_tokens", "grader", "engine", "system_prompt", "math_prompt", "do_sample", "num_beams")
#: The fields ``--allow_different`` may name: they change the answers but not the questions. The
#: prompts (``system_prompt``, ``math_prompt``) are not among them: they are part of each question's
#: prompt hash, so runs under other prompts were not asked the same questions.
MAY_DIFFER = ("max_new_tokens", "grader", "engine")


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)


def run_conditions(run: Run) -> dict[str, Any]:
    """The decoding conditions of ``run`` (:data:`COMPARED`), from its records; a run whose records
    disagree among themselves is an error naming the folder and the field."""
    seen: dict[str, tuple[Any, str]] = {}
    info_decoding = {
        **LEGACY_DECODING,
        **(run.info.get("decoding") or {}),
        "engine": run.info.get("engine", "transformers"),
    }
    for r in run.records:
        decoding = record_producer(r)["decoding"] if r.decoding else info_decoding
        for k in COMPARED:
            v = decoding.get(k)
            first = seen.setdefault(k, (v, f"{r.benchmark}/{r.question_id}"))
            if first[0] != v:
                raise ValueError(
                    f"{run.path}: its records were decoded under two {k} values, {_show(first[0])} "
                    f"(question {first[1]}) and {_show(v)} (question {r.benchmark}/{r.question_id}); "
                    "the folder mixes two evaluations: evaluate again into a new folder"
                )
    return {k: v for k, (v, _) in seen.items()}


def check_comparable(runs: Sequence[Run], allow_different: Iterable[str] = ()) -> list[str]:
    """Refuse runs that were not made under the same conditions (module docstring); returns one line
    per allowed difference (``allow_different`` fields of :data:`MAY_DIFFER`), for the table's header."""
    allow = set(allow_different)
    bad = allow - set(MAY_DIFFER)
    if bad:
        raise ValueError(
            f"allow_different: {sorted(bad)} may not differ (fields that may: {', '.join(MAY_DIFFER)})"
        )
    conditions = [(run, run_conditions(run)) for run in runs]
    errors, allowed = [], []
    for k in COMPARED:
        by_value: dict[str, list[str]] = {}
        for run, cond in conditions:
            by_value.setdefault(_show(cond.get(k)), []).append(str(run.path))
        if len(by_value) < 2:
            continue
        text = f"{k} is " + "; ".join(f"{v} in {', '.join(paths)}" for v, paths in by_value.items())
        (allowed if k in allow else errors).append(text)
    if errors:
        may = [e.split(" ", 1)[0] for e in errors if e.split(" ", 1)[0] in MAY_DIFFER]
        how = (
            f", or pass --allow_different {' '.join(may)} to compare them with the difference in the table's header"
            if len(may) == len(errors)
            else ""
        )
        raise ValueError(
            "the runs were not evaluated under the same conditions: "
            + " | ".join(errors)
            + f"; evaluate them with the same settings{how}"
        )
    return allowed


def check_same_questions(runs: Sequence[Run]) -> None:
    """A question id shared by two runs must be the same question in both (prompt hash, image hash and
    gold, where both records have the field), whether or not the table pairs the two runs: each run's
    records of a benchmark are checked against the first run's that has it. Raises
    :class:`~ncgrpo.eval.stats.AlignmentError` naming both folders."""
    first: dict[str, Run] = {}
    for run in runs:
        for bm, records in run.by_benchmark.items():
            ref = first.setdefault(bm, run)
            if ref is run:
                continue
            try:
                _check_same_questions(records, ref.by_benchmark[bm], bm)
            except AlignmentError as e:
                raise AlignmentError(
                    f"run a = {run.path} ({run.name!r}), run b = {ref.path} ({ref.name!r}): {e}"
                ) from None
