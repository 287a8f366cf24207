"""Power of the seed-level test: the difference a comparison could have detected, and the seeds a
claim needs ("Seeds as the unit" in :mod:`ncgrpo.eval.stats`).

The seed-level test (:func:`~ncgrpo.eval.stats.paired_ttest`) is a two-sided one-sample t-test of the
per-seed differences ``d_s = acc(method_s) - acc(baseline_s)`` (points, s = 1..S) against 0. If the
``d_s`` are normal with mean ``delta`` and standard deviation ``sd``, its statistic
``t = mean(d) / (sd(d) / sqrt(S))`` follows a noncentral t distribution with ``df = S - 1`` and
noncentrality ``nc = delta sqrt(S) / sd``, so at level ``alpha`` (critical value
``c = t_{1 - alpha/2, S-1}``) its power is

    power(delta, sd, S) = P(T > c) + P(T < -c),    T ~ nct(df = S - 1, nc = delta sqrt(S) / sd).

- :func:`ttest_power`: that formula (``scipy.stats.nct``).
- :func:`min_detectable_diff`: the minimum detectable difference (MDD) at ``power`` (80% unless told)
  for S seeds and a seed sd: the ``delta`` solving ``power(delta, sd, S) = 0.8`` (``brentq``). A true
  mean difference smaller than it is more likely missed than found by S seeds.
- :func:`seeds_needed`: the smallest S >= 2 at which an observed mean difference, with the observed
  sd, reaches ``power`` -- how many seeds a claim about that difference needs.
- :func:`seed_power`: both for one comparison's :class:`~ncgrpo.eval.stats.SeedTTest` (``sd`` its
  sample sd of the ``d_s``); with one seed per arm there is no sd to use: no seed-level claim can be
  made, and the seeds needed are those at :data:`REFERENCE_SEED_SD_PP`, the embedded base's.

Plain numpy/scipy only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from ncgrpo.eval.stats.mcnemar import ALPHA


class SeedTTestLike(Protocol):
    """What :func:`seed_power` reads of a :class:`~ncgrpo.eval.stats.SeedTTest` (seeds.py imports this
    module, so not the class itself)."""

    n_seeds: int
    mean_pp: float
    sd_pp: float


#: The power the MDD and the seeds needed are stated at.
POWER = 0.8
#: :func:`seeds_needed` searches up to this many seeds; beyond it says "more than".
SEEDS_NEEDED_CAP = 10_000
#: The seed-to-seed standard deviation (points) of the per-seed difference ``method_s - vanilla_s`` on
#: the embedded base: the pooled sample sd over the README seed table's configurations
#: (``docs/records/seed-table``: 7 configurations x 5 seeds, in-domain, 600 questions; df = 28),
#: ``sqrt(sum_rows sum_s (d_s - mean_row)^2 / sum_rows (S_row - 1))``, recomputed by
#: ``tests/eval/test_power.py`` from the committed records.
#:
#: Why this one: it is the very quantity the seed-level test's sd estimates (the spread of the
#: per-seed *difference*, which carries both arms' seed variance and whatever the shared seed makes
#: them share), pooled over every configuration for 28 degrees of freedom. The alternative, the sd of
#: vanilla's own seeds' accuracies times sqrt(2) (3.2 points), has 4 degrees of freedom and assumes the
#: two arms of a seed pair independent, which pairing by seed need not make them.
REFERENCE_SEED_SD_PP = 2.50

MDD_LABEL = f"MDD at {POWER:.0%} power (pts)"
SEEDS_NEEDED_LABEL = "seeds needed for the mean diff"


def _check_level(name: str, value: float, low: float = 0.0) -> None:
    if not (isinstance(value, int | float) and low < value < 1):
        raise ValueError(f"{name} must be in ({low:g}, 1), got {value!r}")


def _check(delta_pp: float | None, sd_pp: float, alpha: float) -> None:
    _check_level("alpha", alpha)
    if not (math.isfinite(sd_pp) and sd_pp > 0):
        raise ValueError(
            f"sd_pp must be finite and > 0, got {sd_pp!r} (with no seed-to-seed spread the t-test is undefined)"
        )
    if delta_pp is not None and not math.isfinite(delta_pp):
        raise ValueError(f"delta_pp must be finite, got {delta_pp!r}")


def _check_seeds(n_seeds: int) -> None:
    if isinstance(n_seeds, bool) or not isinstance(n_seeds, int | np.integer) or n_seeds < 2:
        raise ValueError(
            f"n_seeds must be an integer >= 2 (the t-test has S - 1 degrees of freedom), got {n_seeds!r}"
        )


def _power(effect: float, n_seeds: int, alpha: float) -> float:
    """Power at standardized effect ``|delta| / sd`` (no checks)."""
    from scipy.stats import nct
    from scipy.stats import t as t_dist

    df = n_seeds - 1
    c = float(t_dist.ppf(1 - alpha / 2, df))
    nc = abs(effect) * math.sqrt(n_seeds)
    # P(T < -c) as P(T' > c) with T' ~ nct(df, -nc): the same number, but scipy's cdf returns nan
    # far in that tail (df = 1, nc > 7), where its sf returns the ~0 it is
    return float(nct.sf(c, df, nc) + nct.sf(c, df, -nc))


def ttest_power(delta_pp: float, sd_pp: float, n_seeds: int, *, alpha: float = ALPHA) -> float:
    """Probability that the two-sided seed-level t-test at ``alpha`` rejects with ``n_seeds`` seeds when
    the per-seed differences are normal with mean ``delta_pp`` and sd ``sd_pp`` (the module's formula).
    ``alpha`` at ``delta_pp = 0``."""
    _check(delta_pp, sd_pp, alpha)
    _check_seeds(n_seeds)
    return _power(delta_pp / sd_pp, int(n_seeds), alpha)


def min_detectable_diff(sd_pp: float, n_seeds: int, *, power: float = POWER, alpha: float = ALPHA) -> float:
    """The minimum detectable difference (points): the mean difference at which the seed-level t-test
    with ``n_seeds`` seeds of sd ``sd_pp`` has ``power`` (solved with ``scipy.optimize.brentq`` on the
    standardized effect, so it is ``sd_pp`` times a function of S, power and alpha)."""
    from scipy.optimize import brentq

    _check(None, sd_pp, alpha)
    _check_seeds(n_seeds)
    _check_level("power", power, low=alpha)
    s = int(n_seeds)
    hi = 1.0
    while _power(hi, s, alpha) < power:
        hi *= 2
    effect = brentq(lambda e: _power(e, s, alpha) - power, 0.0, hi, xtol=1e-12, rtol=1e-12)
    return float(effect * sd_pp)


def seeds_needed(
    delta_pp: float, sd_pp: float, *, power: float = POWER, alpha: float = ALPHA, cap: int = SEEDS_NEEDED_CAP
) -> int | None:
    """The smallest number of seeds S >= 2 at which the seed-level t-test detects a true mean
    difference ``delta_pp`` (sign ignored) with ``power``, per-seed sd ``sd_pp``; None when no S up
    to ``cap`` does (always so for ``delta_pp = 0``: the power is ``alpha`` at every S). Power grows
    with S at a fixed difference, so a bisection over S finds it."""
    _check(delta_pp, sd_pp, alpha)
    _check_level("power", power, low=alpha)
    if not isinstance(cap, int) or cap < 2:
        raise ValueError(f"cap must be an integer >= 2, got {cap!r}")
    effect = abs(delta_pp) / sd_pp
    if effect == 0 or _power(effect, cap, alpha) < power:
        return None
    lo, hi = 1, cap  # power(lo) < power <= power(hi); S = 1 has no test
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _power(effect, mid, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


def pooled_sd(samples: Iterable[Sequence[float]]) -> float:
    """The pooled sample sd of several groups: ``sqrt(sum_g sum_i (x_gi - mean_g)^2 / sum_g (n_g - 1))``;
    groups of one value add nothing. How :data:`REFERENCE_SEED_SD_PP` is computed."""
    ss, df = 0.0, 0
    for i, group in enumerate(samples):
        x = np.asarray(list(group), dtype=float)
        if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
            raise ValueError(f"group {i} must be a flat, non-empty list of finite numbers")
        ss += float(((x - x.mean()) ** 2).sum())
        df += x.size - 1
    if df == 0:
        raise ValueError("pooled_sd needs a group of at least two values")
    return math.sqrt(ss / df)


@dataclass(frozen=True)
class SeedPower:
    """What the seed-level test of one comparison could detect, at ``power`` and ``alpha``.

    ``mean_pp``: the observed mean per-seed difference. ``sd_pp``: the sd the numbers use, the observed
    sample sd of the per-seed differences (``sd_source`` "observed"), or with one seed the embedded
    base's :data:`REFERENCE_SEED_SD_PP` ("reference"). ``mdd_pp``: the MDD for ``n_seeds`` seeds (nan
    with one seed or no spread). ``seeds_needed``: the seeds per arm ``mean_pp`` would need (None: more
    than ``cap``, or the mean is 0, or no spread; ``undefined`` says which).
    """

    n_seeds: int
    mean_pp: float
    sd_pp: float
    sd_source: str
    mdd_pp: float
    seeds_needed: int | None
    power: float
    alpha: float
    cap: int
    undefined: str = ""

    @property
    def mdd_text(self) -> str:
        """The MDD cell of a table: points to one decimal; ``n/a`` with one seed or no spread."""
        return "n/a" if math.isnan(self.mdd_pp) else f"{self.mdd_pp:.1f}"

    @property
    def seeds_needed_text(self) -> str:
        """The seeds-needed cell of a table: the count, ``never`` (mean 0), ``>10,000`` (over the cap);
        ``n/a`` with one seed (the :meth:`note` says what it would need) or no spread."""
        if self.n_seeds < 2 or math.isnan(self.sd_pp):
            return "n/a"
        if self.seeds_needed is not None:
            return str(self.seeds_needed)
        return "never" if self.mean_pp == 0 else f">{self.cap:,}"

    def note(self, label: str = "") -> str | None:
        """With one seed per arm, the sentence that says no seed-level claim can be made and what the
        difference would need at the reference sd; else None."""
        if self.n_seeds != 1:
            return None
        head = f"{label}: " if label else ""
        if self.seeds_needed is not None:
            need = f"would need {self.seeds_needed} seeds per arm"
        elif self.mean_pp == 0:
            need = "is 0: no number of seeds would detect it"
        else:
            need = f"would need more than {self.cap:,} seeds per arm"
        return (
            f"{head}one seed per arm: no seed-level claim can be made (no seed-to-seed spread to test "
            f"against); if its per-seed difference varied across seeds as on ncgrpo's embedded base (sd "
            f"{self.sd_pp:.2f} pts, the README's seed table), the observed difference of "
            f"{self.mean_pp:+.1f} pts {need} for {self.power:.0%} power at alpha {self.alpha}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def seed_power(
    ttest: SeedTTestLike,
    *,
    power: float = POWER,
    alpha: float = ALPHA,
    reference_sd_pp: float = REFERENCE_SEED_SD_PP,
    cap: int = SEEDS_NEEDED_CAP,
) -> SeedPower:
    """The MDD and the seeds needed of one seed-level test (see :class:`SeedPower`). With two or more
    seeds they use the test's observed sd; with one, no seed-level claim can be made, and the seeds
    needed are the observed difference's at ``reference_sd_pp``. With every seed's difference equal
    there is no spread to size them with (as the t-test, :func:`~ncgrpo.eval.stats.paired_ttest`,
    reports no p): nan and None."""
    _check_level("alpha", alpha)
    _check_level("power", power, low=alpha)
    s, mean = ttest.n_seeds, ttest.mean_pp
    common = {"n_seeds": s, "mean_pp": mean, "power": power, "alpha": alpha, "cap": cap}

    def why(need: int | None) -> str:  # why no count of seeds
        if need is not None:
            return ""
        return "the mean difference is 0" if mean == 0 else f"more than {cap:,} seeds"

    if s < 2:
        need = seeds_needed(mean, reference_sd_pp, power=power, alpha=alpha, cap=cap)
        return SeedPower(
            **common, sd_pp=reference_sd_pp, sd_source="reference", mdd_pp=math.nan, seeds_needed=need,
            undefined="; ".join(filter(None, ["one seed: no seed-to-seed spread", why(need)])),
        )  # fmt: skip
    if not ttest.sd_pp > 0:
        return SeedPower(
            **common, sd_pp=math.nan, sd_source="observed", mdd_pp=math.nan, seeds_needed=None,
            undefined="every seed's difference is the same (no spread)",
        )  # fmt: skip
    sd = ttest.sd_pp
    need = seeds_needed(mean, sd, power=power, alpha=alpha, cap=cap)
    return SeedPower(
        **common, sd_pp=sd, sd_source="observed", mdd_pp=min_detectable_diff(sd, s, power=power, alpha=alpha),
        seeds_needed=need, undefined=why(need),
    )  # fmt: skip
