"""The first-token marginal (ncgrpo.core.marginal): the estimator against an independent computation,
and the proposition that NC-GRPO's noisy half samples its first token from q_bar = E_eps[q_eps]:
a goodness-of-fit test of real noisy rows (through the prefill hook and ``generate``) that can fail,
and the direct q_bar sampler (the ``first_token_marginal`` control) giving the same groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from ncgrpo.core.marginal import (
    MarginalCurve,
    antithetic_eps,
    closest_temperature,
    marginal_estimate,
    marginal_keys,
    noisy_probs,
    pool_keys,
    solve_sigma_for_marginal_tv,
)
from ncgrpo.core.noise import NoiseKey, RowNoise, draw_eps, perturb_rows
from ncgrpo.engines.controls import first_token_marginal
from ncgrpo.engines.transformers import prefill_noise
from tiny_models import build_tokenizer, tiny_text_model


def _linear_head(d: int, V: int, seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g) * scale / math.sqrt(d)
    h = torch.randn(d, generator=g)
    return W, h, (lambda x: x @ W.T)


def _independent_marginal_tv(W, h, sigma, draws, seed):
    """TV(q, q_bar) by brute force: fresh torch.randn draws, the calibrated formula written out."""
    g = torch.Generator().manual_seed(seed)
    d = h.numel()
    p = torch.softmax(h @ W.T, -1)
    acc = torch.zeros_like(p, dtype=torch.float64)
    for _ in range(draws // 10_000):
        eps = torch.randn(10_000, d, generator=g)
        ht = h + sigma * h.norm() / math.sqrt(d) * eps
        acc += torch.softmax(ht @ W.T, -1).double().sum(0)
    q_bar = acc / (draws // 10_000 * 10_000)
    return 0.5 * float((q_bar - p.double()).abs().sum())


@pytest.mark.parametrize("sigma", [0.2, 0.5])
def test_marginal_tv_within_monte_carlo_error_of_an_independent_computation(sigma):
    W, h, head = _linear_head(32, 60, seed=1)
    truth = _independent_marginal_tv(W, h, sigma, 400_000, seed=9)
    eps = antithetic_eps(marginal_keys(0, 1, 5, 1024), 32)
    q = noisy_probs(head, h, eps, sigma)
    est = marginal_estimate(torch.softmax(h @ W.T, -1), q, paired=True)
    assert est.tv_per_draw > 1.5 * truth  # one draw moves the distribution far more than the mixture is moved
    assert abs(est.tv - truth) < 4 * est.tv_se + 1e-3, (est, truth)


def test_jackknife_correction_reduces_the_plug_in_bias():
    W, h, head = _linear_head(32, 60, seed=2)
    sigma = 0.3
    truth = _independent_marginal_tv(W, h, sigma, 400_000, seed=3)
    p = torch.softmax(h @ W.T, -1)
    plug, corrected = [], []
    for rep in range(12):
        eps = torch.cat([draw_eps(k, [0], 32) for k in marginal_keys(rep, 1, 5, 128)])
        est = marginal_estimate(p, noisy_probs(head, h, eps, sigma))
        plug.append(est.tv_plugin - truth)
        corrected.append(est.tv - truth)
    assert np.mean(plug) > 0
    assert abs(np.mean(corrected)) < 0.6 * np.mean(plug)


def test_noisy_probs_are_the_hooks_perturbed_distribution_bit_for_bit():
    W, h, head = _linear_head(16, 20, seed=4)
    keys = [NoiseKey(0, 3, 11, j) for j in range(5)]
    rows = [RowNoise(0.4, k) for k in keys]
    ht, _ = perturb_rows(h.expand(5, 1, 16).contiguous(), rows)
    expected = torch.softmax(ht[:, -1] @ W.T / 0.7, -1)
    eps = torch.cat([draw_eps(k, [0], 16) for k in keys])
    assert torch.equal(noisy_probs(head, h, eps, 0.4, temperature=0.7), expected)


def test_closest_temperature_recovers_a_tempered_distribution():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(8, 30, generator=g) * 2
    assert closest_temperature(z, torch.softmax(z / 1.3, -1)) == pytest.approx(1.3, rel=1e-3)
    assert closest_temperature(z, torch.softmax(z, -1)) == pytest.approx(1.0, rel=1e-3)


def test_pool_keys_are_fresh_per_row_and_disjoint_from_rows_and_metric():
    a = pool_keys(NoiseKey(0, 1, 2, 0), 4)
    b = pool_keys(NoiseKey(0, 1, 2, 1), 4)
    metric = marginal_keys(0, 1, 2, 64)
    draws = [k.draw for k in a + b]
    assert len(set(draws)) == 8 and all(d < 0 for d in draws)
    assert not set(draws) & {k.draw for k in metric}


# -- the proposition on a real model -----------------------------------------------------------------
N_ROWS = 4000
SIGMA = 0.8


@pytest.fixture(scope="module")
def peaked():
    """A tiny text model whose LM head is scaled up, so the first token is uncertain but not uniform
    and the noise moves it (a random head at init gives a near-uniform first token)."""
    tok = build_tokenizer()
    model = tiny_text_model("qwen2", tokenizer=tok, hidden_size=64, num_attention_heads=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.eval()
    ids = tok("What is 2 + 3?", return_tensors="pt", add_special_tokens=False)["input_ids"]
    return model, ids


def _first_tokens(model, ids, rows=None, *, keys=None, seed=0):
    n = len(rows) if rows is not None else len(keys)
    inputs = {
        "input_ids": ids.expand(n, -1).contiguous(),
        "attention_mask": torch.ones(n, ids.shape[1], dtype=torch.long),
    }
    torch.manual_seed(seed)
    kw = dict(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=1, pad_token_id=0)
    with torch.no_grad():
        if rows is not None:
            with prefill_noise(model, rows):
                out = model.generate(**inputs, **kw)
        else:
            with first_token_marginal(model, keys, sigma=SIGMA, temperature=1.0, draws=8) as hook:
                out = model.generate(**inputs, **kw)
            assert hook.calls == 1 and hook.rows == list(range(n))
    return out[:, -1]


def _clean_state_and_probs(model, ids):
    cap = {}

    def grab(module, args, output):
        cap.setdefault("h", args[0][0, -1].detach())

    handle = model.lm_head.register_forward_hook(grab)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    handle.remove()
    return cap["h"], torch.softmax(logits.float(), -1)


def _gof_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of sampled tokens to ``probs``; cells with expected count < 5 pooled."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).numpy()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).numpy()
    exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def test_noisy_rows_first_tokens_are_distributed_as_q_bar(peaked):
    model, ids = peaked
    rows = [RowNoise(SIGMA, NoiseKey(0, 1, 7, j)) for j in range(N_ROWS)]
    tokens = _first_tokens(model, ids, rows)
    h, p = _clean_state_and_probs(model, ids)
    eps = torch.cat([draw_eps(k, [0], h.numel()) for k in marginal_keys(0, 1, 7, 20_000)])
    q_bar = noisy_probs(model.lm_head, h, eps, SIGMA).mean(0)
    assert 0.5 * float((q_bar - p).abs().sum()) > 0.05  # the noise moves the marginal here
    assert _gof_p(tokens, q_bar) > 1e-3
    # the test has power: the same tokens are not distributed as the clean q
    assert _gof_p(tokens, p) < 1e-6


def test_direct_q_bar_sampler_gives_the_same_groups_as_nc_grpo(peaked):
    """Groups of n = 4 noisy rows: NC-GRPO's (each row its own eps in the forward) and the control's
    (each row samples from q_hat of a fresh pool, no noise in the forward) have the same distribution of
    first tokens and of the number of distinct first tokens per group (two-sample chi-square)."""
    model, ids = peaked
    n = 4
    nc = _first_tokens(model, ids, [RowNoise(SIGMA, NoiseKey(0, 1, 7, j)) for j in range(N_ROWS)], seed=1)
    ctl = _first_tokens(model, ids, keys=[NoiseKey(0, 1, 7, j) for j in range(N_ROWS)], seed=2)
    clean = _first_tokens(model, ids, [RowNoise()] * N_ROWS, seed=3)

    def two_sample_p(a: torch.Tensor, b: torch.Tensor) -> float:
        cats = torch.unique(torch.cat([a, b]))
        table = np.array([[int((x == c).sum()) for c in cats] for x in (a, b)])
        keep = table.sum(0) >= 10
        table = np.concatenate([table[:, keep], table[:, ~keep].sum(1, keepdims=True)], 1)
        table = table[:, table.sum(0) > 0]
        return float(stats.chi2_contingency(table).pvalue)

    def distinct(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([len(set(g.tolist())) for g in t.view(-1, n)])

    assert two_sample_p(nc, ctl) > 1e-3
    assert two_sample_p(distinct(nc), distinct(ctl)) > 1e-3
    assert two_sample_p(nc, clean) < 1e-6  # power: the clean policy's first tokens differ


# --- the target schedule's solver ----------------------------------------------------------------


def _heads(P: int, d: int = 32, V: int = 60):
    W, _, head = _linear_head(d, V, seed=3)
    h = torch.randn(P, d, generator=torch.Generator().manual_seed(4))
    return head, h, h @ W.T


def test_marginal_curve_is_the_per_prompt_estimate_and_grows_with_sigma():
    head, h, z = _heads(3)
    keys = [k for pid in (11, 12, 13) for k in marginal_keys(0, 2, pid, 32)]
    curve = MarginalCurve(head, h, z, keys, temperature=1.0)
    for i, pid in enumerate((11, 12, 13)):  # prompt i's TV is its own antithetic draws' plug-in TV(q, q_bar)
        eps = antithetic_eps(marginal_keys(0, 2, pid, 32), h.shape[1])
        one = marginal_estimate(
            torch.softmax(z[i], -1), noisy_probs(head, h[i], eps, 0.5), paired=True, correct=False
        )
        assert float(curve(0.5).plugin[i]) == pytest.approx(
            one.tv, rel=1e-6
        )  # a lambda head: no control variate
    tvs = [curve(s).mean for s in (0.05, 0.1, 0.2, 0.4, 0.8)]
    assert tvs == sorted(tvs) and tvs[0] > 0
    assert torch.equal(curve(0.3).tv, curve(0.3).tv)  # common random numbers: a deterministic function
    assert curve.evals == 3 + 5 + 2
    with pytest.raises(ValueError, match="do not match"):
        MarginalCurve(head, h, z, keys[:-1], temperature=1.0)


@pytest.mark.parametrize("target", [0.001, 0.0066, 0.038, 0.2])
def test_solver_reaches_the_target_within_its_tolerance_in_few_evaluations(target):
    head, h, z = _heads(8)
    keys = [k for pid in range(8) for k in marginal_keys(0, 1, pid, 16)]
    curve = MarginalCurve(head, h, z, keys, temperature=1.0)
    calls = []

    def tv_at(s):
        calls.append(s)
        return curve(s).mean

    found = solve_sigma_for_marginal_tv(tv_at, target, start=0.2, sigma_max=10.0)
    assert abs(found.tv - target) <= 0.02 * target, found
    assert found.tv == tv_at(found.sigma) and not found.at_max
    assert found.evals == len(calls) - 1 <= 12
    again = solve_sigma_for_marginal_tv(tv_at, target, start=0.2, sigma_max=10.0)
    assert again == found  # deterministic: a resumed run solves the same sigma_k


def test_solver_bounds_zero_targets_and_nonsense():
    def quad(s):
        return min(1.0, 0.05 * s * s)

    at_max = solve_sigma_for_marginal_tv(quad, 0.5, start=0.2, sigma_max=2.0)
    assert at_max.at_max and at_max.sigma == 2.0 and at_max.tv == pytest.approx(0.2)
    assert solve_sigma_for_marginal_tv(quad, 0.0, start=0.2, sigma_max=2.0).sigma == 0.0
    exact = solve_sigma_for_marginal_tv(quad, 0.002, start=5.0, sigma_max=8.0)  # start above: comes down
    assert exact.sigma == pytest.approx(0.2, rel=0.01)
    with pytest.raises(ValueError, match="target marginal TV"):
        solve_sigma_for_marginal_tv(quad, 1.5, start=0.2, sigma_max=2.0)
    with pytest.raises(ValueError, match="sigma_max"):
        solve_sigma_for_marginal_tv(quad, 0.1, start=0.2, sigma_max=0.0)
    with pytest.raises(ValueError, match="nan"):
        solve_sigma_for_marginal_tv(lambda s: float("nan"), 0.1, start=0.2, sigma_max=2.0)
