"""The batched branch-point code paths give exactly what the per-row / per-prompt paths give.

The trainer's per-step metric work draws every keyed eps of a step in one call
(:func:`ncgrpo.core.noise.draw_eps_keys`), runs all prompts' draws through the head together
(:func:`ncgrpo.core.marginal.noisy_probs` with one state per draw) and bias-corrects them together
(:func:`ncgrpo.core.marginal.marginal_tv`); the hook perturbs the last position alone
(``NoiseHook._perturb_last``). Noise must stay bit-identical (every rank and a resumed run agree on it),
so those are compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from ncgrpo.core import noise as nz
from ncgrpo.core.marginal import branch_eps, marginal_estimate, marginal_keys, marginal_tv, noisy_probs
from ncgrpo.engines.transformers import NoiseHook, _last_index

KEYS = [
    nz.NoiseKey(seed, step, pid, draw)
    for seed in (0, 7)
    for step in (1, 3)
    for pid in (5, 2**62)
    for draw in (-3, 0, 2, -(1 << 40))
]


@pytest.mark.parametrize("mode", ["independent", "antithetic", "rank_one"])
@pytest.mark.parametrize("d", [1, 7, 16, 17, 64, 896])
def test_draw_eps_keys_is_draw_eps_row_by_row(mode, d):
    for position in (0, 3):
        want = torch.cat([nz.draw_eps(k, [position], d, mode=mode) for k in KEYS])
        assert torch.equal(nz.draw_eps_keys(KEYS, position, d, mode=mode), want)
    assert nz.draw_eps_keys([], 0, d, mode=mode).shape == (0, d)
    with pytest.raises(ValueError, match="must be >= 0"):
        nz.draw_eps_keys(KEYS, -1, d, mode=mode)


def test_branch_eps_and_noisy_probs_batched_over_prompts():
    torch.manual_seed(0)
    d, V, M = 16, 40, 8
    head = torch.nn.Linear(d, V)
    states = torch.randn(3, d)
    keys = [marginal_keys(0, 2, pid, M) for pid in (11, 12, 13)]
    eps = branch_eps([k for ks in keys for k in ks], d)
    assert torch.equal(eps, torch.cat([torch.cat([nz.draw_eps(k, [0], d) for k in ks]) for ks in keys]))
    steer = torch.randn(d) * 0.1
    together = noisy_probs(head, states.repeat_interleave(M, 0), eps, 0.3, temperature=0.7, steer=steer)
    one_by_one = torch.cat(
        [
            noisy_probs(head, states[i], eps[i * M : (i + 1) * M], 0.3, temperature=0.7, steer=steer)
            for i in range(3)
        ]
    )
    torch.testing.assert_close(together, one_by_one, rtol=0, atol=1e-7)  # the head's matmul may round apart
    with pytest.raises(ValueError, match="states for"):
        noisy_probs(head, states, eps, 0.3)


@pytest.mark.parametrize("paired", [False, True])
def test_marginal_tv_is_marginal_estimate_per_prompt(paired):
    g = torch.Generator().manual_seed(1)
    P, M, V = 4, 16, 30
    p = torch.softmax(torch.randn(P, V, generator=g), -1)
    q = torch.softmax(torch.randn(P, M, V, generator=g) * 0.3 + p.log()[:, None], -1)
    got = marginal_tv(p, q, paired=paired)
    want = [marginal_estimate(p[i], q[i], paired=paired).tv for i in range(P)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert (got >= 0).all()
    with pytest.raises(ValueError, match="do not match"):
        marginal_tv(p[:2], q)


def test_last_index_is_the_last_real_token():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B, T = torch.randint(1, 9, (2,), generator=g).tolist()
        mask = (torch.rand(B, T, generator=g) < 0.6).long()
        rev = nz.reverse_positions(mask)
        want = [int((rev[b] == 0).nonzero()[0]) if (rev[b] == 0).any() else T - 1 for b in range(B)]
        assert _last_index(mask, B, T, torch.device("cpu")).tolist() == want
    assert _last_index(None, 3, 5, torch.device("cpu")).tolist() == [4, 4, 4]


@pytest.mark.parametrize("mode", ["independent", "antithetic", "rank_one"])
@pytest.mark.parametrize("steer", [False, True])
def test_perturb_last_is_perturb_rows_on_the_last_position(mode, steer):
    torch.manual_seed(0)
    B, T, d = 6, 5, 16
    h = torch.randn(B, T, d)
    rows = [
        nz.RowNoise(),
        nz.RowNoise(0.3, nz.NoiseKey(0, 1, 9, 0), mode=mode),
        nz.RowNoise(0.3, nz.NoiseKey(0, 1, 9, 0), sign=-1.0, mode=mode),
        nz.RowNoise(),
        nz.RowNoise(0.5, nz.NoiseKey(0, 1, 4, 1), mode=mode),
        nz.RowNoise(0.5, nz.NoiseKey(0, 1, 4, 2), mode=mode),  # all padding below: stays clean
    ]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0
    mask[5] = 0
    mu = torch.randn(d) * 0.1 if steer else None
    hook = NoiseHook(rows, None, 0.5, mu, "auto", False)
    for m in (mask, None):
        got, rel = hook._perturb_last(h, None if m is None else m[:, -1])
        tail, want_rel = nz.perturb_rows(
            h[:, -1:], rows, attention_mask=None if m is None else m[:, -1:], steer=mu
        )
        assert torch.equal(got, torch.cat([h[:, :-1], tail], 1))
        assert torch.equal(rel, want_rel)
    assert torch.equal(got[0], h[0]) and not torch.equal(got[1, -1], h[1, -1])
