"""The synthetic suite's splits: items of every family (:mod:`ncgrpo.toy.synthetic`) drawn into
train, validation and test, deduplicated by content, and exported in Geometry3K's schema."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ncgrpo.data.types import Question
from ncgrpo.toy.synthetic import DEFAULT_SIZES, FAMILIES, LETTERS, SPLITS, Family, Item, render

__all__ = ["build_suite", "content_hash", "export_geo3k", "first_per_family", "make_question"]


# -------------------------------------------------------------------------------------------- suite


def content_hash(family_name: str, problem: str, spec: Mapping[str, Any]) -> str:
    """Identity of an item's content (the image is a function of the spec): used to dedupe splits."""
    blob = json.dumps({"family": family_name, "problem": problem, "spec": spec}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def make_question(fam: Family, item: Item, key: str, *, split: str, index: int, seed: int) -> Question:
    """The :class:`Question` of a sampled item (image rendered from its spec); ``key`` is its content hash."""
    return Question(
        benchmark=f"synthetic/{fam.name}",
        question_id=f"{split}-{index:05d}",
        problem=item.problem,
        answer=item.answer,
        images=[render(item.spec["scene"])],
        choices=item.choices,
        answer_type=fam.answer_type,
        role=fam.role,
        metadata={"family": fam.name, "split": split, "seed": seed, "hash": key, "spec": item.spec},
    )


def build_suite(seed: int = 0, sizes: Mapping[str, int] | None = None) -> dict[str, list[Question]]:
    """Generate the suite: ``train`` (in-domain family only, ``sizes["train"]`` items), and
    ``validation`` / ``test`` (every family, ``sizes[split]`` items each). Splits share no item
    (by content hash). Each (split, family) draws from its own stream, and the eval splits are drawn
    first, so the test split is unchanged when only the train size changes."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    unknown = set(sizes) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; splits are {SPLITS}")
    seen: set[str] = set()
    suite: dict[str, list[Question]] = {}
    for split in ("test", "validation", "train"):
        questions: list[Question] = []
        fams = [f for f in FAMILIES if f.role == "in_domain"] if split == "train" else FAMILIES
        for fam in fams:
            rng = random.Random(f"ncgrpo-synthetic/{seed}/{split}/{fam.name}")
            count, tries = 0, 0
            while count < sizes[split]:
                tries += 1
                if tries > 20 * sizes[split] + 100:
                    raise RuntimeError(f"{fam.name}: too many duplicate draws for {split}")
                item = fam.sample(rng)
                key = content_hash(fam.name, item.problem, item.spec)
                if key in seen:
                    continue
                seen.add(key)
                questions.append(make_question(fam, item, key, split=split, index=count, seed=seed))
                count += 1
        suite[split] = questions
    return {split: suite[split] for split in SPLITS}


def first_per_family(questions: Sequence[Any], limit: int | None) -> list[Any]:
    """The first ``limit`` questions of each family (benchmark ``synthetic/<family>``), in order; all of
    them when ``limit`` is None."""
    if limit is None:
        return list(questions)
    seen: dict[str, int] = {}
    kept = []
    for q in questions:
        if seen.get(q.benchmark, 0) < limit:
            seen[q.benchmark] = seen.get(q.benchmark, 0) + 1
            kept.append(q)
    return kept


def export_geo3k(suite: Mapping[str, list[Question]], out_dir: str | Path) -> dict[str, Path]:
    """Write ``out_dir/data/<split>-00000-of-00001.parquet`` in hiyouga/geometry3k's schema
    (``images``, ``problem``, ``answer``, ``id``, ``choices``, ``ground_truth``) plus ``family``,
    ``role``, ``answer_type``, ``question_id`` and ``spec`` (JSON). As in geometry3k, a
    multiple-choice row's ``answer`` is the option text and ``ground_truth`` its letter; otherwise both
    are the answer. ``datasets.load_dataset("parquet", data_files=...)`` reads it back."""
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    features = Features(
        {
            "images": Sequence(ImageFeature()),
            "problem": Value("string"),
            "answer": Value("string"),
            "id": Value("int64"),
            "choices": Sequence(Value("string")),
            "ground_truth": Value("string"),
            "family": Value("string"),
            "role": Value("string"),
            "answer_type": Value("string"),
            "question_id": Value("string"),
            "spec": Value("string"),
        }
    )
    data_dir = Path(out_dir) / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, questions in suite.items():
        cols: dict[str, list[Any]] = {name: [] for name in features}
        for i, q in enumerate(questions):
            cols["images"].append(q.images)
            cols["problem"].append(q.problem)
            cols["answer"].append(q.choices[LETTERS.index(q.answer)] if q.choices else q.answer)
            cols["id"].append(i)
            cols["choices"].append(list(q.choices or []))
            cols["ground_truth"].append(q.answer)
            cols["family"].append(q.metadata["family"])
            cols["role"].append(q.role)
            cols["answer_type"].append(q.answer_type)
            cols["question_id"].append(q.question_id)
            cols["spec"].append(json.dumps(q.metadata["spec"], sort_keys=True))
        path = data_dir / f"{split}-00000-of-00001.parquet"
        Dataset.from_dict(cols, features=features).to_parquet(str(path))
        paths[split] = path
    return paths
