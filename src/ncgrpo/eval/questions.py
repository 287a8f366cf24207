"""The questions an evaluation asks: built-in benchmarks, an exported synthetic suite, or benchmarks
of one's own, read by name (``ncgrpo eval``, ``ncgrpo probe`` and the benchmarks call it)."""

from __future__ import annotations

from pathlib import Path

from ncgrpo.data.benchmarks import BENCHMARKS, load_benchmark


def load_questions(
    names: list[str],
    paths: dict[str, Path | None],
    split: str | None,
    limit: int | None,
    roles: dict[str, str] | None = None,
):
    """The questions of ``names`` (benchmark -> data path or None for the ``datasets`` cache; a name
    that is not built in is a benchmark of one's own, read from its path). ``roles``: benchmark ->
    role where ``--data NAME=PATH:ROLE`` gave one.

    A benchmark that yields no question is an error naming where it was read.
    """
    roles = roles or {}
    questions = []
    for n in names:
        if n == "synthetic":
            if paths.get(n) is None:
                raise ValueError("benchmark 'synthetic' needs --data synthetic=FOLDER (an exported suite)")
            got = load_benchmark("geo3k", paths[n], split=split or "test", limit=limit)
        elif n in BENCHMARKS or paths.get(n) is not None:
            got = load_benchmark(n, paths.get(n), split=split, limit=limit, role=roles.get(n))  # type: ignore[arg-type]
        else:
            raise ValueError(
                f"unknown benchmark {n!r}; known: synthetic, {', '.join(BENCHMARKS)}; a benchmark of your own "
                f"needs its file: --data {n}=FILE.jsonl[:in-domain|ood|general]"
            )
        if not got:
            where = paths.get(n) or "the datasets cache"
            raise ValueError(
                f"benchmark {n!r}: no questions in {where} (split {split or 'default'}); "
                "is the file empty or the split wrong?"
            )
        questions += got
    return questions
