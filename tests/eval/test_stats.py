"""Paired statistics (paper section 4.1: exact McNemar, pooled over benchmarks and seeds)."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ncgrpo.eval.stats import (
    AlignmentError,
    align,
    bonferroni,
    holm,
    macro_accuracy,
    mcnemar_exact,
    mcnemar_pooled,
    mean_half_range,
    per_benchmark,
    pooled,
    pooled_over_seeds,
)


def paired(n11: int, n10: int, n01: int, n00: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrays (a, b) with the given 2x2 counts; n10 = a right and b wrong."""
    a = np.array([1] * n11 + [1] * n10 + [0] * n01 + [0] * n00, dtype=bool)
    b = np.array([1] * n11 + [0] * n10 + [1] * n01 + [0] * n00, dtype=bool)
    return a, b


def rec(bm: str, qid: str, correct: bool) -> SimpleNamespace:
    return SimpleNamespace(benchmark=bm, question_id=qid, correct=correct)


# --- mcnemar_exact on worked 2x2 tables ------------------------------------------------------


def test_worked_example_10_vs_2():
    # n10=10 wins, n01=2 losses, 12 discordant pairs; two-sided exact:
    # p = 2 * sum_{k<=2} C(12,k) / 2^12 = 2 * (1 + 12 + 66) / 4096 = 158/4096 = 0.0385742...
    a, b = paired(n11=50, n10=10, n01=2, n00=38)
    r = mcnemar_exact(a, b)
    assert (r.n, r.n10, r.n01) == (100, 10, 2)
    assert r.p == pytest.approx(158 / 4096, rel=1e-12)
    assert r.acc_a == pytest.approx(0.60) and r.acc_b == pytest.approx(0.52)
    assert r.diff_pp == pytest.approx(8.0)
    # Direction does not change a two-sided p; it flips the sign of the difference.
    r2 = mcnemar_exact(b, a)
    assert (r2.n10, r2.n01, r2.p, r2.diff_pp) == (2, 10, r.p, -8.0)


def test_no_discordant_pairs_gives_p_one():
    a, b = paired(n11=7, n10=0, n01=0, n00=3)
    r = mcnemar_exact(a, b)
    assert r.p == 1.0 and r.diff_pp == 0.0 and r.discordant == 0


def test_all_discordant_one_way():
    # 6 wins, 0 losses: p = 2 / 2^6 = 0.03125 (the smallest one-sided count reaching p<0.05);
    # 5 wins, 0 losses: p = 2 / 2^5 = 0.0625.
    assert mcnemar_exact(*paired(0, 6, 0, 0)).p == pytest.approx(0.03125)
    assert mcnemar_exact(*paired(0, 5, 0, 0)).p == pytest.approx(0.0625)


def test_balanced_discordance_is_p_one():
    # n01 = n10 = 5: the observed split is the most likely one, p = 1.
    assert mcnemar_exact(*paired(20, 5, 5, 20)).p == pytest.approx(1.0)


def test_input_validation():
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar_exact([True, False], [True])
    with pytest.raises(ValueError, match="at least one"):
        mcnemar_exact([], [])
    with pytest.raises(ValueError, match="booleans"):
        mcnemar_exact([0, 2], [1, 1])
    assert mcnemar_exact([1, 0, 1], [0, 0, 1]).n10 == 1  # 0/1 ints are accepted


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=200))
def test_p_matches_closed_form(pairs):
    # Two-sided exact binomial at 1/2 is symmetric: p = min(1, 2 * P[X <= min(n01, n10)]).
    a = np.array([x for x, _ in pairs])
    b = np.array([y for _, y in pairs])
    r = mcnemar_exact(a, b)
    d = r.n01 + r.n10
    expected = (
        1.0 if d == 0 else min(1.0, 2 * sum(math.comb(d, k) for k in range(min(r.n01, r.n10) + 1)) / 2**d)
    )
    assert r.p == pytest.approx(expected, rel=1e-9)
    assert r.diff_pp == pytest.approx(100 * (a.mean() - b.mean()))


# --- alignment -------------------------------------------------------------------------------


def test_align_pairs_by_key_regardless_of_order():
    ra = [rec("x", "2", True), rec("x", "1", False), rec("y", "1", True)]
    rb = [rec("y", "1", False), rec("x", "1", True), rec("x", "2", True)]
    p = align(ra, rb)
    assert p.keys == [("x", "1"), ("x", "2"), ("y", "1")]
    assert p.a.tolist() == [False, True, True] and p.b.tolist() == [True, True, False]
    assert align(ra, rb, benchmark="x").keys == [("x", "1"), ("x", "2")]


def test_align_error_names_missing_ids_and_counts():
    ra = [rec("mathvista", str(i), True) for i in range(10)]
    rb = [rec("mathvista", str(i), True) for i in range(3, 12)]
    with pytest.raises(AlignmentError) as e:
        align(ra, rb)
    msg = str(e.value)
    assert "10 vs 9 questions" in msg
    assert "missing from run a: 2 (mathvista/10, mathvista/11)" in msg
    assert "missing from run b: 3 (mathvista/0, mathvista/1, mathvista/2)" in msg


def test_align_error_truncates_long_lists():
    ra = [rec("b", f"{i:03d}", True) for i in range(100)]
    with pytest.raises(
        AlignmentError,
        match=r"missing from run b: 100 \(b/000, b/001, b/002, b/003, b/004, \.\.\. \(95 more\)\)",
    ):
        align(ra, [rec("b", "zzz", True)])


def test_align_rejects_conflicting_duplicates_and_empty_benchmark():
    with pytest.raises(AlignmentError, match="twice"):
        align([rec("b", "1", True), rec("b", "1", False)], [rec("b", "1", True)])
    with pytest.raises(AlignmentError, match="no records on benchmark 'nope'"):
        align([rec("b", "1", True)], [rec("b", "1", True)], benchmark="nope")


# --- per-benchmark and pooled tests ----------------------------------------------------------


def _records(bm: str, a: np.ndarray, b: np.ndarray, prefix: str = "q") -> tuple[list, list]:
    return (
        [rec(bm, f"{prefix}{i}", bool(x)) for i, x in enumerate(a)],
        [rec(bm, f"{prefix}{i}", bool(y)) for i, y in enumerate(b)],
    )


def test_per_benchmark_and_pooled_equal_direct_computation():
    rng = np.random.default_rng(0)
    ra, rb, arrays = [], [], []
    for bm, n in [("b1", 50), ("b2", 80), ("b3", 30)]:
        a, b = rng.random(n) < 0.6, rng.random(n) < 0.5
        x, y = _records(bm, a, b)
        ra += x
        rb += y
        arrays.append((bm, a, b))
    tests = per_benchmark(ra, rb)
    for bm, a, b in arrays:
        assert tests[bm] == mcnemar_exact(a, b)
    # Pooled over two benchmarks = one test on the concatenated outcomes.
    direct = mcnemar_exact(
        np.concatenate([arrays[0][1], arrays[1][1]]), np.concatenate([arrays[0][2], arrays[1][2]])
    )
    assert pooled(ra, rb, ["b1", "b2"]) == direct
    assert mcnemar_pooled([(arrays[0][1], arrays[0][2]), (arrays[1][1], arrays[1][2])]) == direct
    assert pooled(ra, rb, ["b1", "b2"]).n == 130


def test_pooled_over_seeds_concatenates_seed_pairs():
    rng = np.random.default_rng(1)
    seeds, direct_a, direct_b = [], [], []
    for _ in range(2):
        a, b = rng.random(60) < 0.55, rng.random(60) < 0.5
        c, d = rng.random(40) < 0.7, rng.random(40) < 0.7
        xa, xb = _records("ood1", a, b)
        ya, yb = _records("ood2", c, d)
        seeds.append((xa + ya, xb + yb))
        direct_a += [a, c]
        direct_b += [b, d]
    r = pooled_over_seeds(seeds, ["ood1", "ood2"])
    assert r == mcnemar_exact(np.concatenate(direct_a), np.concatenate(direct_b))
    assert r.n == 2 * 100  # each question counted once per seed pair (paper: 2 x 10,671 = 21,342)


def test_pooled_needs_benchmarks():
    with pytest.raises(ValueError):
        pooled([rec("b", "1", True)], [rec("b", "1", True)], [])


# --- summaries and corrections ---------------------------------------------------------------


def test_mean_half_range_paper_seed_numbers():
    # Paper, "Seed variance": OOD average 51.9 ± 0.1 (vanilla) over two seeds, e.g. 51.8 and 52.0.
    mean, half = mean_half_range([51.8, 52.0])
    assert mean == pytest.approx(51.9) and half == pytest.approx(0.1)
    assert mean_half_range([53.0]) == (53.0, 0.0)


def test_macro_accuracy_is_unweighted():
    # Paper Table 1 vanilla OOD: (70.2 + 70.7 + 43.0 + 27.1 + 49.1) / 5 = 52.02.
    assert macro_accuracy([70.2, 70.7, 43.0, 27.1, 49.1]) == pytest.approx(52.02)
    assert macro_accuracy({"a": 0.5, "b": 1.0}) == pytest.approx(0.75)


def test_holm_and_bonferroni_worked_example():
    # m = 3, p = (0.01, 0.02, 0.03):
    #   Bonferroni: 3p = (0.03, 0.06, 0.09)                 -> reject only the first.
    #   Holm: sorted p times (3, 2, 1) = (0.03, 0.04, 0.03), running max (0.03, 0.04, 0.04)
    #         -> all three rejected at 0.05 (Holm is uniformly more powerful).
    adj, rej = bonferroni([0.01, 0.02, 0.03])
    np.testing.assert_allclose(adj, [0.03, 0.06, 0.09])
    assert rej.tolist() == [True, False, False]
    adj, rej = holm([0.01, 0.02, 0.03])
    np.testing.assert_allclose(adj, [0.03, 0.04, 0.04])
    assert rej.tolist() == [True, True, True]


def test_holm_unsorted_input_and_step_down_stop():
    # p = (0.04, 0.005, 0.03, 0.01), m = 4. Sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04
    # -> running max 0.02, 0.03, 0.06, 0.06. The step-down stops at 0.03 (> 0.05/2), so 0.04 is not
    # rejected although 0.04 < 0.05/1.
    adj, rej = holm([0.04, 0.005, 0.03, 0.01])
    np.testing.assert_allclose(adj, [0.06, 0.02, 0.06, 0.03])
    assert rej.tolist() == [False, True, False, True]
    # p = (0.4, 0.3): 0.3*2 = 0.6, then 0.4*1 = 0.4 raised to the running max 0.6 (monotone).
    np.testing.assert_allclose(holm([0.4, 0.3])[0], [0.6, 0.6])
    np.testing.assert_allclose(holm([0.9, 0.8])[0], [1.0, 1.0])  # 0.8*2 = 1.6 capped at 1
    with pytest.raises(ValueError):
        holm([0.5, 1.5])


def test_stats_does_not_import_torch():
    code = "import sys, ncgrpo.eval.stats; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
