"""The seed-level test's power (``ncgrpo.eval.stats.power``): the formula against simulated
experiments run through the very t-test the seed level uses, its edge cases, and the reference sd
against the committed records it is computed from."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ncgrpo.eval.stats import (
    ALPHA,
    POWER,
    REFERENCE_SEED_SD_PP,
    SEEDS_NEEDED_CAP,
    align,
    min_detectable_diff,
    paired_ttest,
    pooled_sd,
    seed_differences,
    seed_power,
    seeds_needed,
    ttest_power,
)

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "records" / "seed-table"
EXPERIMENTS = 2_000


def simulated_power(delta: float, sd: float, n_seeds: int, seed: int) -> float:
    """Share of EXPERIMENTS simulated experiments (normal per-seed differences, mean ``delta``, sd
    ``sd``) in which :func:`paired_ttest`, the seed-level test, rejects at ALPHA."""
    rng = np.random.default_rng(seed)
    diffs = rng.normal(delta, sd, size=(EXPERIMENTS, n_seeds))
    return float(np.mean([paired_ttest(d).p < ALPHA for d in diffs]))


# --- the formula against simulation ----------------------------------------------------------


@pytest.mark.parametrize("n_seeds", [3, 5, 10])
def test_simulated_experiments_at_the_mdd_have_the_stated_power(n_seeds: int) -> None:
    sd = 2.5
    mdd = min_detectable_diff(sd, n_seeds)
    assert ttest_power(mdd, sd, n_seeds) == pytest.approx(POWER, abs=1e-9)
    # 2,000 experiments: the binomial sd of the share is 0.9 points, so 3 points is 3.4 sd
    assert simulated_power(mdd, sd, n_seeds, seed=n_seeds) == pytest.approx(POWER, abs=0.03)
    assert simulated_power(-mdd, sd, n_seeds, seed=100 + n_seeds) == pytest.approx(
        POWER, abs=0.03
    )  # two-sided


def test_simulated_power_at_the_seeds_needed_and_one_fewer() -> None:
    delta, sd = 1.5, 2.5  # 0.6 sd
    n = seeds_needed(delta, sd)
    assert n == 24
    assert ttest_power(delta, sd, n) >= POWER > ttest_power(delta, sd, n - 1)
    assert simulated_power(delta, sd, n, seed=1) >= POWER - 0.03
    assert simulated_power(delta, sd, n - 1, seed=2) < POWER + 0.03


def test_power_at_no_difference_is_alpha_in_simulation_too() -> None:
    assert ttest_power(0.0, 2.5, 5) == pytest.approx(ALPHA, abs=1e-12)
    assert simulated_power(0.0, 2.5, 5, seed=3) == pytest.approx(ALPHA, abs=0.015)


def test_known_values() -> None:
    # one-sample t, two-sided alpha 0.05, 80% power: the standardized effect for n = 5 and 10 is the
    # textbook 1.68 and 1.00; the mdd scales with the sd
    assert min_detectable_diff(1.0, 5) == pytest.approx(1.682, abs=1e-3)
    assert min_detectable_diff(1.0, 10) == pytest.approx(0.996, abs=1e-3)
    assert min_detectable_diff(2.5, 5) == pytest.approx(2.5 * min_detectable_diff(1.0, 5))
    # with many seeds it tends to the normal approximation (z_0.975 + z_0.8) sd / sqrt(S)
    assert min_detectable_diff(1.0, 2_000) == pytest.approx(
        (1.959964 + 0.841621) / math.sqrt(2_000), rel=1e-3
    )
    # at S = 2 (df = 1) the far lower tail is where scipy's nct.cdf gives nan: the power stays a number
    assert 0 < ttest_power(30.0, 1.0, 2) <= 1 and min_detectable_diff(1.0, 2) == pytest.approx(
        11.55, abs=0.01
    )


def test_seeds_needed_grows_as_the_difference_shrinks_and_has_a_cap() -> None:
    assert seeds_needed(12.0, 1.0) == 2 and seeds_needed(11.0, 1.0) == 3  # the MDD at 2 seeds is 11.55 sd
    counts = [seeds_needed(d, 2.5) for d in (4.0, 2.0, 1.0, 0.5)]
    assert counts == sorted(counts) and len(set(counts)) == 4
    assert seeds_needed(0.01, 3.0) is None  # ~706,000 seeds: over the cap
    assert seeds_needed(0.01, 3.0, cap=1_000_000) == pytest.approx(706_000, rel=0.01)
    assert seeds_needed(-2.0, 2.5) == seeds_needed(2.0, 2.5)  # two-sided


# --- edge cases -----------------------------------------------------------------------------


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="sd_pp must be finite and > 0, got 0"):
        min_detectable_diff(0.0, 5)
    with pytest.raises(ValueError, match="sd_pp"):
        ttest_power(1.0, -1.0, 5)
    with pytest.raises(ValueError, match="sd_pp"):
        seeds_needed(1.0, math.nan)
    with pytest.raises(ValueError, match="n_seeds must be an integer >= 2.*got 1"):
        ttest_power(1.0, 1.0, 1)
    with pytest.raises(ValueError, match="n_seeds"):
        min_detectable_diff(1.0, 2.5)
    for alpha in (0, 1, -0.1, 1.5):
        with pytest.raises(ValueError, match=f"alpha must be in \\(0, 1\\), got {alpha}"):
            min_detectable_diff(1.0, 5, alpha=alpha)
    for power in (0.05, 0.01, 1.0):  # at or below alpha no difference is needed; 1 needs an infinite one
        with pytest.raises(ValueError, match=f"power must be in \\(0.05, 1\\), got {power}"):
            seeds_needed(1.0, 1.0, power=power)
    with pytest.raises(ValueError, match="delta_pp must be finite"):
        ttest_power(math.inf, 1.0, 5)
    with pytest.raises(ValueError, match="cap must be an integer >= 2"):
        seeds_needed(1.0, 1.0, cap=1)
    with pytest.raises(ValueError, match="alpha"):
        seed_power(paired_ttest([1.0, 2.0]), alpha=2)


def test_no_difference_never_reaches_the_power() -> None:
    assert seeds_needed(0.0, 2.5) is None
    p = seed_power(paired_ttest([1.0, -1.0, 0.0]))  # mean 0, sd 1
    assert (p.mdd_pp, p.seeds_needed, p.seeds_needed_text) == (
        pytest.approx(min_detectable_diff(1.0, 3)),
        None,
        "never",
    )
    assert p.undefined == "the mean difference is 0"


def test_seed_power_of_a_seed_level_test() -> None:
    t = paired_ttest([2.0, -1.0, 3.0, 0.5, 4.0])
    p = seed_power(t)
    assert (p.n_seeds, p.mean_pp, p.sd_pp, p.sd_source) == (5, t.mean_pp, t.sd_pp, "observed")
    assert p.mdd_pp == pytest.approx(min_detectable_diff(t.sd_pp, 5))
    assert p.seeds_needed == seeds_needed(t.mean_pp, t.sd_pp) and p.note() is None
    assert (p.mdd_text, p.seeds_needed_text) == (f"{p.mdd_pp:.1f}", str(p.seeds_needed))
    # over the cap
    far = seed_power(paired_ttest([0.01, -3.0, 3.02]))
    assert far.seeds_needed is None and far.seeds_needed_text == f">{SEEDS_NEEDED_CAP:,}"
    # every seed alike: no spread, nothing to size (as the t-test gives no p)
    flat = seed_power(paired_ttest([2.0, 2.0, 2.0]))
    assert (
        math.isnan(flat.mdd_pp)
        and flat.seeds_needed is None
        and (flat.mdd_text, flat.seeds_needed_text) == ("n/a", "n/a")
    )


def test_one_seed_says_no_seed_level_claim_and_uses_the_reference_sd() -> None:
    p = seed_power(paired_ttest([3.0]))
    assert (p.sd_pp, p.sd_source, p.mdd_text, p.seeds_needed_text) == (
        REFERENCE_SEED_SD_PP,
        "reference",
        "n/a",
        "n/a",
    )
    assert p.seeds_needed == seeds_needed(3.0, REFERENCE_SEED_SD_PP)
    assert p.note("X") == (
        "X: one seed per arm: no seed-level claim can be made (no seed-to-seed spread to test against); if "
        "its per-seed difference varied across seeds as on ncgrpo's embedded base (sd 2.50 pts, the README's "
        f"seed table), the observed difference of +3.0 pts would need {p.seeds_needed} seeds per arm for 80% "
        "power at alpha 0.05"
    )
    zero, small = seed_power(paired_ttest([0.0])), seed_power(paired_ttest([0.01]))
    assert "is 0: no number of seeds would detect it" in zero.note()
    assert zero.undefined == "one seed: no seed-to-seed spread; the mean difference is 0"
    assert "more than 10,000 seeds per arm" in small.note()
    assert small.undefined == "one seed: no seed-to-seed spread; more than 10,000 seeds"


def test_pooled_sd() -> None:
    # groups (1, 3) and (2, 4, 9): squares 2 + 26 over df 1 + 2
    assert pooled_sd([[1.0, 3.0], [2.0, 4.0, 9.0], [5.0]]) == pytest.approx(math.sqrt(28 / 3))
    with pytest.raises(ValueError, match="at least two values"):
        pooled_sd([[1.0], [2.0]])
    with pytest.raises(ValueError, match="group 1"):
        pooled_sd([[1.0, 2.0], []])


# --- the reference sd, from the committed records ------------------------------------------


def test_the_reference_sd_is_the_committed_records_pooled_seed_sd() -> None:
    from ncgrpo.toy.seed_table import IN_DOMAIN, VANILLA_SLUG, load_runs

    _, runs = load_runs([RECORDS])
    vanilla = runs[VANILLA_SLUG].seeds
    diffs = [
        seed_differences(
            (p.a, p.b)
            for p in (align(rows.seeds[s], vanilla[s], benchmark=IN_DOMAIN) for s in sorted(rows.seeds))
        )
        for slug, rows in runs.items()
        if slug != VANILLA_SLUG and len(rows.seeds) > 1
    ]
    assert len(diffs) >= 7
    sd = pooled_sd(diffs)
    assert round(sd, 2) == REFERENCE_SEED_SD_PP, (
        f"REFERENCE_SEED_SD_PP is {REFERENCE_SEED_SD_PP}, but the records in {RECORDS} give a pooled sd of "
        f"{sd:.4f} over {len(diffs)} configurations: set it to {sd:.2f} in src/ncgrpo/eval/stats/power.py "
        "(and say how many configurations and degrees of freedom in its comment)"
    )
