"""The synthetic visual-math suite: determinism, disjoint splits, answers re-derived by an independent
solver (tests/toy/solver.py) and checked against the pixels, the blank-image ablation, traces and the
Geometry3K-schema export."""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from ncgrpo.data.types import MATH_PROMPT
from ncgrpo.toy.suite import build_suite, content_hash, export_geo3k
from ncgrpo.toy.synthetic import FAMILIES, IMAGE_SIZE, family
from ncgrpo.toy.traces import (
    DIRECT_SHARE,
    SHORTCUT_ANSWERS,
    corpus,
    reasoning_trace,
    reasoning_traces,
    shortcut_trace,
    trace_variant,
    warmup_trace,
)

try:  # tests/data may or may not be a package
    from .solver import check_image, solve
except ImportError:
    from solver import check_image, solve

SIZES = {"train": 300, "validation": 20, "test": 80}


@pytest.fixture(scope="module")
def suite():
    return build_suite(seed=0, sizes=SIZES)


def _fingerprint(questions):
    return [
        (q.uid, q.problem, q.answer, q.choices, q.images[0].tobytes(), q.metadata["hash"]) for q in questions
    ]


def test_same_seed_same_bytes_different_seed_different(suite):
    again = build_suite(seed=0, sizes=SIZES)
    for split in suite:
        assert _fingerprint(again[split]) == _fingerprint(suite[split])
    other = build_suite(seed=1, sizes=SIZES)
    for split in suite:
        a = {q.images[0].tobytes() for q in suite[split]}
        b = {q.images[0].tobytes() for q in other[split]}
        assert len(a & b) < 0.05 * len(a), split  # at most a few tiny-scene coincidences


_DIGEST = (
    "import hashlib; from ncgrpo.toy.suite import build_suite; h = hashlib.sha256(); "
    "[h.update(q.uid.encode() + q.problem.encode() + q.answer.encode() + q.images[0].tobytes()) "
    "for qs in build_suite(3, {'train': 40, 'validation': 4, 'test': 8}).values() for q in qs]; "
    "print(h.hexdigest())"
)


def test_bytes_do_not_depend_on_the_process_hash_seed():
    out = {
        subprocess.run(
            [sys.executable, "-c", _DIGEST],
            env={**os.environ, "PYTHONHASHSEED": hs},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hs in ("1", "2")
    }
    assert len(out) == 1


def test_family_streams_do_not_share_global_state(suite):
    random.seed(123)  # global state must not matter
    fam = family("geometry")
    a = [fam.make(random.Random(7)) for _ in range(3)]
    random.seed(456)
    b = [fam.make(random.Random(7)) for _ in range(3)]
    assert [x.image.tobytes() for x in a] == [x.image.tobytes() for x in b]


def test_split_sizes_roles_and_ids(suite):
    assert set(suite) == {"train", "validation", "test"}
    assert len(suite["train"]) == SIZES["train"]
    assert {q.role for q in suite["train"]} == {"in_domain"}
    for split in ("validation", "test"):
        per_family = Counter(q.metadata["family"] for q in suite[split])
        assert per_family == {f.name: SIZES[split] for f in FAMILIES}
    roles = {f.name: f.role for f in FAMILIES}
    assert sorted(roles.values()).count("in_domain") == 1 and list(roles.values()).count("general") == 1
    assert list(roles.values()).count("ood") >= 3
    uids = [q.uid for split in suite.values() for q in split]
    assert len(uids) == len(set(uids))
    for split in suite.values():
        for q in split:
            assert q.benchmark == f"synthetic/{q.metadata['family']}"
            assert q.role == roles[q.metadata["family"]]
            assert q.problem.startswith("<image>") and q.problem.count("<image>") == 1
            assert json.loads(json.dumps(q.metadata["spec"])) == q.metadata["spec"]  # plain JSON
            assert len(q.images) == 1 and q.images[0].size == (IMAGE_SIZE, IMAGE_SIZE)
            assert q.images[0].mode == "RGB"


def test_splits_are_disjoint_by_content_and_pixels(suite):
    by_hash = {split: {q.metadata["hash"] for q in qs} for split, qs in suite.items()}
    by_pixels = {split: {(q.problem, q.images[0].tobytes()) for q in qs} for split, qs in suite.items()}
    for split, qs in suite.items():
        assert len(by_hash[split]) == len(qs)  # no duplicate inside a split either
        for q in qs:
            assert q.metadata["hash"] == content_hash(q.metadata["family"], q.problem, q.metadata["spec"])
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        assert not by_hash[a] & by_hash[b]
        assert not by_pixels[a] & by_pixels[b]


def test_test_split_is_stable_when_train_size_changes(suite):
    bigger = build_suite(seed=0, sizes={**SIZES, "train": 500})
    assert _fingerprint(bigger["test"]) == _fingerprint(suite["test"])
    assert _fingerprint(bigger["train"][: SIZES["train"]]) == _fingerprint(suite["train"])


def test_every_answer_matches_the_independent_solver_and_the_pixels(suite):
    for split in suite.values():
        for q in split:
            spec = q.metadata["spec"]
            assert solve(spec) == q.answer, (q.uid, spec)
            check_image(q.images[0], spec)
            if q.choices is not None:
                assert q.answer_type == "choice" and len(q.choices) == 4 and q.answer in "ABCD"
                for letter, option in zip("ABCD", q.choices, strict=True):
                    assert f"\n{letter}. {option}" in q.problem


@pytest.mark.parametrize(
    "kind, corrupt",
    [
        ("perimeter", lambda sc: sc["labels"][0].update(text=str(int(sc["labels"][0]["text"]) % 6 + 2))),
        (
            "missing_angle",
            lambda sc: sc["labels"][1].update(text=str(int(sc["labels"][1]["text"]) % 90 + 10)),
        ),
        ("sides", lambda sc: sc.update(fill="green" if sc["fill"] != "green" else "red")),
        ("count", lambda sc: sc["objects"].pop()),
        (
            "compare",
            lambda sc: sc["objects"][0].update(
                colour="red" if sc["objects"][0]["colour"] != "red" else "blue"
            ),
        ),
        ("tallest", lambda sc: sc["bars"][2].update(height=sc["bars"][2]["height"] % 6 + 1)),
    ],
)
def test_pixel_check_can_fail(suite, kind, corrupt):
    """The spec-vs-image check is not vacuous: a spec edited after rendering is caught."""
    q = next(q for qs in suite.values() for q in qs if q.metadata["spec"]["ask"]["kind"] == kind)
    spec = copy.deepcopy(q.metadata["spec"])
    corrupt(spec["scene"])
    with pytest.raises(AssertionError):
        check_image(q.images[0], spec)


def test_traces_score_correct_under_the_shared_scorer(suite):
    rewards = pytest.importorskip("ncgrpo.rewards")
    for qs in suite.values():
        for q in qs[::5]:
            for trace in reasoning_traces(q):
                assert rewards.format_ok(trace)
                assert rewards.score(trace, q.answer, choices=q.choices, answer_type=q.answer_type).correct, (
                    trace
                )


def test_answer_values_cover_each_family(suite):
    answers = defaultdict(set)
    for q in suite["test"]:
        answers[q.metadata["family"]].add(q.answer)
    assert answers["compare"] == {"left", "right"}
    assert answers["pope"] == {"yes", "no"}
    assert answers["colour_choice"] == set("ABCD")
    assert answers["counting"] == {str(n) for n in range(1, 10)}


@functools.cache
def _draws(name: str, n: int = 5000) -> list:
    """n text/answer/spec draws (no images) from one family, shared by the ablation tests."""
    fam, rng = family(name), random.Random(f"ablation/{name}")
    return [fam.sample(rng) for _ in range(n)]


def _text_only_accuracy(items) -> float:
    """Held-out accuracy of the best text-only predictor (majority answer given the exact problem
    text, falling back to the overall majority for unseen texts) fitted on the first half."""
    fit, held = items[: len(items) // 2], items[len(items) // 2 :]
    by_text = defaultdict(Counter)
    for it in fit:
        by_text[it.problem][it.answer] += 1
    overall = Counter(it.answer for it in fit).most_common(1)[0][0]
    guess = {text: c.most_common(1)[0][0] for text, c in by_text.items()}
    return sum(guess.get(it.problem, overall) == it.answer for it in held) / len(held)


# Chance per family: E_text[max_a P(a | text)], the best a blank image allows.
#   geometry:      (1/4 sides + 1/4 angle sum + 1/13 perimeter + 1/13 third angle) / 4 = 0.163
#   counting:      1/9 (1..9)      bar_chart: (1/4 tallest + 1/6 value) / 2 = 0.208
#   compare:       1/2 (left/right) colour_choice: 1/4 (A-D)   pope: 1/2 (yes/no)
EXPECTED_CHANCE = {
    "geometry": (1 / 4 + 1 / 4 + 1 / 13 + 1 / 13) / 4,
    "counting": 1 / 9,
    "bar_chart": (1 / 4 + 1 / 6) / 2,
    "compare": 1 / 2,
    "colour_choice": 1 / 4,
    "pope": 1 / 2,
}


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_blank_image_ablation_text_alone_is_at_chance(fam):
    assert fam.chance == pytest.approx(EXPECTED_CHANCE[fam.name])
    acc = _text_only_accuracy(_draws(fam.name))
    # 2500 held-out draws: one standard error is <= 0.01, so +0.05 can only fail if text leaks
    assert acc <= fam.chance + 0.05, (fam.name, acc, fam.chance)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_answers_are_uniform_within_each_problem_text(fam):
    """Per text, no answer is more than 1.5x its uniform share (on 5000 draws): the generator
    draws the answer independently of the wording, so the chance rate above is the real one."""
    by_text = defaultdict(Counter)
    for it in _draws(fam.name):
        by_text[it.problem][it.answer] += 1
    for text, counts in by_text.items():
        total = sum(counts.values())
        if total < 400:  # many-texts families (colour_choice) are covered by the ablation test
            continue
        assert max(counts.values()) / total <= 1.5 / len(counts), (text, counts)


def test_pope_yes_no_balance(suite):
    probe = [q for q in suite["test"] if q.metadata["family"] == "pope"]
    assert all(q.role == "general" and q.answer_type == "yesno" for q in probe)
    share = sum(q.answer == "yes" for q in probe) / len(probe)
    assert 0.4 <= share <= 0.6
    rng = random.Random("pope-balance")
    big = [family("pope").sample(rng) for _ in range(4000)]
    assert abs(sum(it.answer == "yes" for it in big) / len(big) - 0.5) < 0.03
    # half of the scenes hold a near miss (same colour or same shape as the asked object), yes or no
    for answer in ("yes", "no"):
        sub = [it for it in big if it.answer == answer]
        assert abs(sum(it.spec["ask"]["near_miss"] for it in sub) / len(sub) - 0.5) < 0.05


def test_reasoning_traces_are_short_correct_and_boxed(suite):
    fmt = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # NoisyRollout's format reward
    for split in suite.values():
        for q in split:
            for trace in reasoning_traces(q):
                assert trace.endswith(f"\\boxed{{{q.answer}}}"), trace
                assert fmt.fullmatch(trace)
                assert len(re.findall(r"\w+|[^\w\s]", trace)) < 40, trace
                for expr, value in re.findall(r"([\d()+*\- ]+[+*-][\d()+*\- ]*) = (\d+)", trace):
                    assert eval(expr) == int(value), trace  # noqa: S307 - digits and operators only


def test_corpus_holds_problems_and_traces(suite):
    texts = list(corpus(suite))
    assert texts[0] == MATH_PROMPT
    n = sum(len(qs) for qs in suite.values())
    n_traces = sum(
        len(reasoning_traces(q)) + (shortcut_trace(q) is not None) for qs in suite.values() for q in qs
    )
    assert len(texts) == 1 + n + n_traces
    assert suite["test"][0].problem in texts and reasoning_trace(suite["test"][0]) in texts
    words = {w for t in texts for w in re.findall(r"[a-z]+", t)}
    assert len(words) < 150  # a small, templated vocabulary


def test_export_round_trips_through_datasets(suite, tmp_path):
    datasets = pytest.importorskip("datasets")
    small = {split: qs[:: max(1, len(qs) // 24)] for split, qs in suite.items()}
    paths = export_geo3k(small, tmp_path / "synthetic")
    assert sorted(p.name for p in (tmp_path / "synthetic" / "data").iterdir()) == [
        "test-00000-of-00001.parquet",
        "train-00000-of-00001.parquet",
        "validation-00000-of-00001.parquet",
    ]
    loaded = datasets.load_dataset(
        "parquet",
        data_files={split: str(path) for split, path in paths.items()},
        cache_dir=str(tmp_path / "cache"),
    )
    for split, qs in small.items():
        ds = loaded[split]
        assert ds.column_names[:6] == ["images", "problem", "answer", "id", "choices", "ground_truth"]
        assert {"family", "role", "answer_type"} <= set(ds.column_names)
        assert isinstance(ds.features["images"], datasets.List | datasets.Sequence)
        assert len(ds) == len(qs)
        for i, (row, q) in enumerate(zip(ds, qs, strict=True)):
            assert row["id"] == i and row["question_id"] == q.question_id
            assert row["problem"] == q.problem and row["ground_truth"] == q.answer
            assert row["choices"] == (q.choices or [])
            assert row["answer"] == (q.choices["ABCD".index(q.answer)] if q.choices else q.answer)
            assert (row["family"], row["role"], row["answer_type"]) == (
                q.metadata["family"],
                q.role,
                q.answer_type,
            )
            assert len(row["images"]) == 1
            assert row["images"][0].convert("RGB").tobytes() == q.images[0].tobytes()


def test_default_sizes_build():
    full = build_suite(seed=0)
    assert len(full["train"]) == 2000
    assert len(full["validation"]) == 64 * len(FAMILIES) and len(full["test"]) == 200 * len(FAMILIES)


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="unknown split"):
        build_suite(sizes={"dev": 3})


def test_export_loads_back_through_the_project_geo3k_loader(suite, tmp_path):
    geometry3k = pytest.importorskip("ncgrpo.data.geometry3k")
    small = {split: qs[:: max(1, len(qs) // 12)] for split, qs in suite.items()}
    export_geo3k(small, tmp_path)
    for split, qs in small.items():
        loaded = geometry3k.load_geometry3k(tmp_path, split=split)
        key = lambda q: (q.uid, q.problem, q.answer, q.choices, q.answer_type, q.role)  # noqa: E731
        assert [key(q) for q in loaded] == [key(q) for q in qs]
        assert [q.images[0].convert("RGB").tobytes() for q in loaded] == [q.images[0].tobytes() for q in qs]


def test_in_domain_traces_open_in_several_ways_and_the_warmup_spreads_over_them(suite):
    """The branch point: several different first reasoning tokens per in-domain question (four
    derivations and the shortcut), and the warm-up's pick (trace_variant) takes the shortcut on
    about DIRECT_SHARE of the questions and spreads the rest over the derivations."""
    geo = [q for q in suite["train"] if q.metadata["family"] == "geometry"]
    for q in geo[:50]:
        traces = reasoning_traces(q)
        firsts = {t[len("<think>") :].split()[0] for t in [*traces, shortcut_trace(q)]}
        assert len(traces) == 4 and len(firsts) >= 4, traces
        assert reasoning_trace(q) == traces[0] and shortcut_trace(q).startswith("<think>answer: ")
    picks = Counter(trace_variant(q) for q in geo)
    assert set(picks) == set(range(5)), picks
    assert abs(picks[4] / len(geo) - DIRECT_SHARE) < 0.1, picks
    assert min(picks[k] for k in range(4)) > len(geo) * (1 - DIRECT_SHARE) / 4 * 0.6, picks
    for q in geo[:50]:
        k = trace_variant(q)
        assert warmup_trace(q) == (shortcut_trace(q) if k == 4 else reasoning_trace(q, k))
    ood = [q for q in suite["test"] if q.role != "in_domain"]
    assert all(trace_variant(q) == 0 and len(reasoning_traces(q)) == 1 for q in ood)
    assert all(shortcut_trace(q) is None and warmup_trace(q) == reasoning_trace(q) for q in ood)


def test_colour_traces_read_the_shape_then_name_the_option_that_has_it(suite):
    """One fact per step: the asked shape's colour as drawn in the scene, then the option letter that
    has that colour (no walk through the options: the tiny base learnt to read the colour from the
    walk but not where to stop)."""
    qs = [q for q in suite["test"] if q.metadata["family"] == "colour_choice"]
    assert len(qs) >= 20
    for q in qs:
        ask, objects = q.metadata["spec"]["ask"], q.metadata["spec"]["scene"]["objects"]
        (drawn,) = [ob["colour"] for ob in objects if ob["shape"] == ask["shape"]]
        assert q.choices[ord(q.answer) - ord("A")] == drawn
        body = reasoning_trace(q)[len("<think>") : reasoning_trace(q).index("</think>")]
        assert body == f"the {ask['shape']} is {drawn}. {q.answer} is {drawn}. so {q.answer}."


def test_the_shortcut_ignores_the_figure_and_is_mostly_wrong(suite):
    """The habit RL should unlearn: the same boxed answer for every question of a kind, whatever the
    figure, so it is right only when the figure happens to match (well under half the time), while
    every derivation is right; it still has NoisyRollout's format."""
    from ncgrpo.rewards import format_ok, score

    geo = [q for q in suite["test"] if q.metadata["family"] == "geometry"]
    by_kind: dict[str, list[bool]] = {}
    for q in geo:
        trace = shortcut_trace(q)
        kind = q.metadata["spec"]["ask"]["kind"]
        assert (
            trace == f"<think>answer: {SHORTCUT_ANSWERS[kind]}.</think> \\boxed{{{SHORTCUT_ANSWERS[kind]}}}"
        )
        assert format_ok(trace)
        by_kind.setdefault(kind, []).append(score(trace, q.answer, answer_type=q.answer_type).correct)
    assert set(by_kind) == set(SHORTCUT_ANSWERS)
    rate = sum(sum(v) for v in by_kind.values()) / len(geo)
    assert 0.05 < rate < 0.25, {k: sum(v) / len(v) for k, v in by_kind.items()}
