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
    BOOTSTRAP_RESAMPLES,
    AlignmentError,
    align,
    align_seeds,
    bonferroni,
    disagreement_note,
    hierarchical_bootstrap,
    holm,
    macro_accuracy,
    mcnemar_exact,
    mcnemar_pooled,
    mean_half_range,
    paired_ttest,
    per_benchmark,
    pooled,
    pooled_over_seeds,
    seed_differences,
    seed_level,
    seed_to_seed,
    seed_ttest,
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


# --- seeds as the unit -----------------------------------------------------------------------


def seeds_with_diffs(counts: list[tuple[int, int]], n: int = 200) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (method, baseline) pair per seed with the given (wins n10, losses n01) on n questions."""
    return [paired(n11=n // 4, n10=w, n01=lo, n00=n - n // 4 - w - lo) for w, lo in counts]


def test_seed_differences_are_per_seed_accuracy_differences():
    pairs = seeds_with_diffs([(10, 4), (3, 9), (6, 6)])
    np.testing.assert_allclose(seed_differences(pairs), [3.0, -3.0, 0.0])
    for (a, b), d in zip(pairs, seed_differences(pairs), strict=True):
        assert d == pytest.approx(100 * (a.mean() - b.mean()))
    with pytest.raises(ValueError, match="seed pair 1: paired arrays differ in length"):
        seed_differences([([True], [False]), ([True, True], [False])])
    with pytest.raises(ValueError, match="at least one seed pair"):
        seed_differences([])


def test_paired_ttest_equals_scipy_on_hand_data():
    from scipy.stats import ttest_1samp, ttest_rel

    method = [35.2, 31.0, 35.0]  # README's NC-GRPO σ0=0.2 seeds, against vanilla's
    vanilla = [33.0, 32.7, 32.3]
    r = paired_ttest(np.subtract(method, vanilla))
    ref = ttest_rel(method, vanilla)
    assert r.t == pytest.approx(ref.statistic, rel=1e-12) and r.p == pytest.approx(ref.pvalue, rel=1e-12)
    assert r.df == 2 and r.n_seeds == 3 and r.undefined == ""
    assert r.mean_pp == pytest.approx(np.mean(np.subtract(method, vanilla)))
    ci = ref.confidence_interval(0.95)
    assert (r.ci_low_pp, r.ci_high_pp) == (pytest.approx(ci.low), pytest.approx(ci.high))
    # t, p, the interval at another level, by hand: mean / (sd / sqrt(S)), t quantile on S - 1 df
    d = [1.5, -0.3, 2.2, 0.7, 4.1]
    one = ttest_1samp(d, 0.0)
    r = paired_ttest(d, confidence=0.9)
    assert r.p == pytest.approx(one.pvalue, rel=1e-12) and r.df == 4
    assert r.t == pytest.approx(np.mean(d) / (np.std(d, ddof=1) / np.sqrt(5)), rel=1e-12)
    ci = one.confidence_interval(0.9)
    assert (r.ci_low_pp, r.ci_high_pp) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert r.sd_pp == pytest.approx(np.std(d, ddof=1))


@given(
    st.lists(st.floats(-30, 30, allow_nan=False).map(lambda x: round(x, 2)), min_size=2, max_size=8).filter(
        lambda d: np.ptp(d) > 0.05
    )
)
def test_paired_ttest_p_matches_scipy_for_any_seeds(d):
    from scipy.stats import ttest_1samp

    assert paired_ttest(d).p == pytest.approx(ttest_1samp(d, 0.0).pvalue, rel=1e-9, abs=1e-12)


def test_seed_ttest_is_the_ttest_of_the_accuracies():
    from scipy.stats import ttest_rel

    pairs = seeds_with_diffs([(12, 4), (9, 7), (15, 3)], n=300)
    r = seed_ttest(pairs)
    ref = ttest_rel([a.mean() for a, _ in pairs], [b.mean() for _, b in pairs])
    assert r.p == pytest.approx(ref.pvalue, rel=1e-9)
    assert r.mean_pp == pytest.approx(100 * np.mean([a.mean() - b.mean() for a, b in pairs]))


def test_identical_to_the_baseline_gives_zero_and_p_one():
    rng = np.random.default_rng(3)
    base = [rng.random(150) < 0.4 for _ in range(3)]
    level = seed_level([(b.copy(), b) for b in base])
    assert level.mean_pp == 0.0 and level.p == 1.0 and level.ttest.t == 0.0
    assert (level.ttest.ci_low_pp, level.ttest.ci_high_pp) == (0.0, 0.0)
    assert (level.bootstrap.low_pp, level.bootstrap.high_pp) == (0.0, 0.0)
    assert "every seed's difference is 0" in level.ttest.undefined


def test_ttest_undefined_cases_say_why():
    one = paired_ttest([2.5])
    assert math.isnan(one.p) and math.isnan(one.ci_low_pp) and one.df == 0 and "one seed" in one.undefined
    tied = seed_ttest(seeds_with_diffs([(8, 2), (7, 1), (6, 0)]))  # +3 pp in every seed
    assert tied.diffs_pp == (3.0, 3.0, 3.0) and math.isnan(tied.p)
    assert (tied.ci_low_pp, tied.ci_high_pp) == (3.0, 3.0) and "+3.00 pp" in tied.undefined
    with pytest.raises(ValueError, match="finite"):
        paired_ttest([1.0, math.nan])
    with pytest.raises(ValueError, match="confidence"):
        paired_ttest([1.0, 2.0], confidence=95)


def test_bootstrap_is_seeded_and_contains_the_point_estimate():
    pairs = seeds_with_diffs([(14, 6), (9, 8), (20, 5)])
    ci = hierarchical_bootstrap(pairs)
    assert ci.n_resamples == BOOTSTRAP_RESAMPLES and ci.seed == 0
    assert ci.mean_pp == pytest.approx(np.mean(seed_differences(pairs)))
    assert ci.low_pp < ci.mean_pp < ci.high_pp
    assert hierarchical_bootstrap(pairs) == ci  # same generator seed, same interval
    assert hierarchical_bootstrap(pairs, seed=1) != ci
    with pytest.raises(ValueError, match="n_resamples"):
        hierarchical_bootstrap(pairs, n_resamples=0)


@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(1, 40)), min_size=1, max_size=5)
)
def test_bootstrap_interval_contains_the_point_estimate(seeds):
    pairs = [paired(n11=0, n10=w, n01=lo, n00=ties) for w, lo, ties in seeds]
    ci = hierarchical_bootstrap(pairs, n_resamples=2000)
    assert ci.low_pp <= ci.mean_pp + 1e-9 and ci.mean_pp - 1e-9 <= ci.high_pp


def test_bootstrap_widens_when_seeds_disagree_more():
    # Same mean difference (+3 pp) on the same 400 questions per seed; the seeds agree, then scatter.
    agree = seeds_with_diffs([(20, 8), (20, 8), (20, 8)], n=400)
    scatter = seeds_with_diffs([(8, 20), (20, 8), (40, 4)], n=400)  # -3, +3, +9 pp
    assert np.mean(seed_differences(agree)) == pytest.approx(np.mean(seed_differences(scatter)))
    narrow, wide = hierarchical_bootstrap(agree), hierarchical_bootstrap(scatter)
    assert wide.high_pp - wide.low_pp > 1.5 * (narrow.high_pp - narrow.low_pp)
    # and seed variance alone is not all of it: identical seeds still leave the question variance
    assert narrow.high_pp - narrow.low_pp > 0


def test_bootstrap_question_stage_matches_the_normal_width():
    # One seed: only questions vary. The resampled mean difference has sd sqrt(var(d) / n) (d in
    # {-1, 0, 1} per question), so the 95% interval is about ± 1.96 of it.
    n, wins, losses = 1000, 150, 90
    (a, b) = paired(n11=300, n10=wins, n01=losses, n00=n - 300 - wins - losses)
    d = a.astype(int) - b.astype(int)
    half = 1.96 * 100 * d.std() / np.sqrt(n)
    ci = hierarchical_bootstrap([(a, b)])
    assert (ci.high_pp - ci.low_pp) / 2 == pytest.approx(half, rel=0.05)
    # and the seed stage: many questions per seed (question noise small), seeds +0 / +10 pp
    big = seeds_with_diffs([(0, 0), (2000, 0)], n=20_000)
    ci = hierarchical_bootstrap(big)
    assert ci.low_pp == pytest.approx(0.0, abs=0.5) and ci.high_pp == pytest.approx(10.0, abs=0.5)


def test_seed_to_seed_null():
    s0 = np.array([1, 1, 0, 0, 1, 0, 1, 0, 0, 0], dtype=bool)
    s1 = np.array([1, 0, 1, 0, 1, 0, 1, 1, 0, 0], dtype=bool)  # differs from s0 on 3 questions
    s2 = s0.copy()
    null = seed_to_seed({0: s0, 1: s1, 2: s2})
    assert null.pairs == ((0, 1), (0, 2), (1, 2))
    assert null.differ == (0.3, 0.0, 0.3) and null.mean_differ == pytest.approx(0.2)
    assert null.tests[0] == mcnemar_exact(s0, s1) and null.tests[1].p == 1.0
    assert null.pooled == mcnemar_exact(np.concatenate([s0, s0, s1]), np.concatenate([s1, s2, s2]))
    consecutive = seed_to_seed({0: s0, 1: s1, 2: s2}, pairs=[(0, 1), (1, 2)])
    assert consecutive.differ == (0.3, 0.3) and consecutive.pooled.n == 20
    with pytest.raises(ValueError, match="at least two seeds"):
        seed_to_seed({0: s0})
    with pytest.raises(ValueError, match="different numbers of questions"):
        seed_to_seed({0: s0, 1: s1[:5]})
    with pytest.raises(ValueError, match="no outcomes for seed 7"):
        seed_to_seed({0: s0, 1: s1}, pairs=[(0, 7)])


def test_disagreement_note():
    assert disagreement_note(0.01, 0.02, n_seeds=3) is None  # both significant
    assert disagreement_note(0.3, 0.6, n_seeds=3) is None  # neither
    assert disagreement_note(0.01, math.nan, n_seeds=1) is None  # seed-level undefined
    note = disagreement_note(0.00002, 0.21, n_seeds=3, label="NoisyRollout (image)")
    assert note is not None and "\n" not in note
    assert note.startswith("NoisyRollout (image): question-level pooled McNemar p < 1e-4 is below 0.05")
    assert "seed-level p = 0.21 (3 seeds) is not" in note
    note = disagreement_note(0.24, 0.015, n_seeds=3, label="SPSA")
    assert note is not None and note.startswith("SPSA: seed-level p = 0.015 (3 seeds) is below 0.05")
    assert disagreement_note(0.05, 0.049, n_seeds=3) is not None  # p = alpha is not significant


def test_align_seeds_keeps_seeds_apart():
    rng = np.random.default_rng(5)
    pairs, direct = [], []
    for _ in range(2):
        a, b = rng.random(30) < 0.5, rng.random(30) < 0.5
        c, d = rng.random(20) < 0.5, rng.random(20) < 0.5
        xa, xb = _records("ood1", a, b)
        ya, yb = _records("ood2", c, d)
        pairs.append((ya + xa, xb + yb))  # order of records does not matter
        direct.append((np.concatenate([a, c]), np.concatenate([b, d])))
    got = align_seeds(pairs, ["ood1", "ood2"])
    for (ga, gb), (da, db) in zip(got, direct, strict=True):  # (align sorts the question ids)
        assert mcnemar_exact(ga, gb) == mcnemar_exact(da, db) and ga.size == 50
    assert pooled_over_seeds(pairs, ["ood1", "ood2"]) == mcnemar_pooled(direct)
