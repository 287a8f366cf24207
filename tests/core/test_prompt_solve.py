"""The per-prompt target solve (ncgrpo.core.prompt_solve): each prompt's own sigma reaches the target TV
within the solver's tolerance, independently of the other prompts in the batch; the lockstep rounds
are each prompt's own solve exactly; and it is what narrows the prompts' spread of TVs that one shared
sigma leaves."""

from __future__ import annotations

import math

import pytest
import torch

from ncgrpo.core.marginal import MarginalCurve, marginal_keys, solve_sigma_for_marginal_tv
from ncgrpo.core.prompt_solve import curve_tv_at, solve_per_prompt


def _batch(P: int = 6, d: int = 48, V: int = 97, seed: int = 0):
    """A linear head and P states whose peakedness differs by prompt (as real prompts' do)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, V, bias=False)
    head.weight.data = torch.randn(V, d, generator=g) / math.sqrt(d)
    head.requires_grad_(False)
    peak = torch.linspace(1.5, 5.0, P)[:, None]
    h = torch.randn(P, d, generator=g) * peak
    return head, h, head(h)


def _curve(head, h, z, ids=None, pairs=32):
    ids = list(range(h.shape[0])) if ids is None else ids
    keys = [k for pid in ids for k in marginal_keys(7, 3, pid, pairs)]
    return MarginalCurve(head, h, z, keys, temperature=1.0)


@pytest.mark.parametrize("target,start,smax", [(0.01, 0.2, 10.0), (0.3, 0.2, 2.0), (0.002, 5.0, 8.0)])
def test_the_lockstep_solve_is_each_prompts_own_solve(target, start, smax):
    """All prompts driven in lockstep give, per prompt, what the one-function solver gives on that
    prompt's own TV: the rounds only batch the evaluations, they change no iterate."""
    head, h, z = _batch()
    curve = _curve(head, h, z)
    found = solve_per_prompt(curve, target, start=start, sigma_max=smax)
    evals, rounds = 0, 0
    for i in range(curve.P):
        alone = solve_sigma_for_marginal_tv(
            lambda s, i=i: curve_tv_at(curve, {i: s})[i], target, start=start, sigma_max=smax
        )
        assert (float(found.sigma[i]), float(found.tv[i]), bool(found.at_max[i])) == (
            alone.sigma,
            alone.tv,
            alone.at_max,
        )
        evals, rounds = evals + alone.evals, max(rounds, alone.evals)
    assert (found.evals, found.rounds) == (evals, rounds)  # a round: one evaluation of each unfinished prompt


def test_each_prompt_reaches_the_target():
    head, h, z = _batch()
    curve = _curve(head, h, z)
    spread = curve(0.3).tv
    target = float(spread.median())
    found = solve_per_prompt(curve, target, start=0.3, sigma_max=20.0)
    assert not found.at_max.any()
    assert torch.all((found.tv - target).abs() <= 0.02 * target), found.tv
    # the achieved TVs, measured again at the solved sigmas, are the ones reported
    again = curve_tv_at(curve, {i: float(s) for i, s in enumerate(found.sigma)})
    assert [again[i] for i in range(curve.P)] == found.tv.tolist()
    # one shared sigma leaves the prompts far apart; the solve brings every one to the target
    assert float(spread.max() / spread.min()) > 3
    assert float(found.sigma.max() / found.sigma.min()) > 1.5
    s = found.summary()
    assert s["sigma_min"] <= s["sigma_mean"] <= s["sigma_max"] and s["at_max"] == 0 and s["evals"] >= curve.P


def test_a_prompt_solves_the_same_whatever_shares_its_batch():
    head, h, z = _batch(P=6)
    full = solve_per_prompt(_curve(head, h, z), 0.02, start=0.2, sigma_max=20.0)
    for keep in ([0, 3], [5], [1, 2, 4]):
        idx = torch.tensor(keep)
        part = solve_per_prompt(_curve(head, h[idx], z[idx], ids=keep), 0.02, start=0.2, sigma_max=20.0)
        assert part.sigma.tolist() == full.sigma[idx].tolist()


def test_sigma_max_bounds_a_prompt_and_says_so():
    head, h, z = _batch()
    curve = _curve(head, h, z)
    found = solve_per_prompt(curve, 0.5, start=0.2, sigma_max=0.5)
    assert found.at_max.all() and torch.all(found.sigma == 0.5)
    zero = solve_per_prompt(curve, 0.0, start=0.2, sigma_max=2.0)
    assert zero.rounds == 0 and torch.all(zero.sigma == 0)


def test_curve_tv_at_is_the_curve_at_each_prompts_sigma():
    head, h, z = _batch(P=5)
    curve = _curve(head, h, z)
    sig = {0: 0.1, 1: 0.4, 2: 0.1, 3: 0.4, 4: 0.7}
    got = curve_tv_at(curve, sig)
    for i, s in sig.items():
        assert got[i] == pytest.approx(float(curve(s).tv[i]), rel=1e-4)
    # bit for bit what the prompt's curve alone gives
    for i, s in sig.items():
        alone = _curve(head, h[i : i + 1], z[i : i + 1], ids=[i])
        assert got[i] == float(alone(s).tv[0])
