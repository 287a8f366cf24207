"""Tests of the pure noise core (ncgrpo.core.noise): eq. (1)-(4), (6), Proposition 1, keyed streams."""

from __future__ import annotations

import math

import pytest
import torch

from ncgrpo.core.noise import (
    NoiseKey,
    RowNoise,
    agreement_kernel,
    calibrated_delta,
    depth_decayed_sigmas,
    draw_direction,
    draw_eps,
    noise_seed,
    perturb,
    perturb_rows,
    perturb_selected,
    project_ball,
    relative_perturbation,
    reverse_positions,
    spsa_gradient,
    spsa_update,
)


# ---------------------------------------------------------------------------------------------
# Proposition 1: E||h~ - h||^2 = sigma^2 ||h||^2 and Var(||h~ - h||^2 / (sigma^2 ||h||^2)) = 2/d
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [8, 64, 1024])
@pytest.mark.parametrize("sigma", [0.2, 0.5])
def test_proposition_1_moments(d: int, sigma: float) -> None:
    n = 4000
    gen = torch.Generator().manual_seed(d)
    h = torch.randn(d, generator=gen) * 7.3  # any fixed state; ||h|| arbitrary
    eps = torch.stack([draw_eps(NoiseKey(0, 1, i, 0), [0], d)[0] for i in range(n)])  # [n, d]
    h_tilde = perturb(h.expand(n, d), eps, sigma)  # [n, d]
    x = ((h_tilde - h).double().pow(2).sum(-1) / (sigma**2 * h.double().pow(2).sum())).numpy()  # [n]

    # X = chi2_d / d: mean 1, variance 2/d, 4th central moment 48/d^3 + 12/d^2.
    var = 2.0 / d
    mu4 = 48.0 / d**3 + 12.0 / d**2
    se_mean = math.sqrt(var / n)
    se_var = math.sqrt((mu4 - var**2) / n)
    assert abs(x.mean() - 1.0) < 5 * se_mean, (x.mean(), se_mean)
    assert abs(x.var(ddof=1) - var) < 5 * se_var, (x.var(ddof=1), var, se_var)


def test_proposition_1_is_width_invariant_and_exact_in_expectation() -> None:
    # The displacement is sigma * ||h|| / sqrt(d) * eps, so its squared norm over sigma^2 ||h||^2 is exactly
    # ||eps||^2 / d for every h: the ratio does not depend on ||h||.
    d = 32
    eps = draw_eps(NoiseKey(3, 2, 1, 0), [0, 1, 2], d)  # [3, d]
    for scale in (1e-3, 1.0, 1e4):
        h = torch.linspace(-1, 1, d).expand(3, d) * scale
        delta = calibrated_delta(h, eps, 0.3)
        ratio = delta.pow(2).sum(-1) / (0.09 * h.pow(2).sum(-1))
        torch.testing.assert_close(ratio, eps.pow(2).sum(-1) / d, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# eq. (2): numerics
# ---------------------------------------------------------------------------------------------
def test_zero_norm_rows_get_zero_displacement() -> None:
    h = torch.zeros(2, 16)
    out = perturb(h, torch.randn(2, 16), 0.5)
    assert torch.equal(out, h)
    assert torch.equal(relative_perturbation(h, out), torch.zeros(2))


def test_non_finite_input_is_a_clear_error() -> None:
    h = torch.ones(2, 4)
    h[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        perturb(h, torch.randn(2, 4), 0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchecked_non_finite_rows_are_returned_as_they_were(dtype: torch.dtype) -> None:
    """check_finite=False (no host read, for an engine step that must not sync): a row holding inf or
    NaN comes back as it was, where the float32 sum and the low-precision clamp would have changed it
    (inf -> the dtype's max); the finite rows get their noise as with the check."""
    h = torch.randn(3, 8).to(dtype)
    h[0, 1], h[2, 5] = float("inf"), float("nan")
    eps = torch.randn(3, 8)
    out = perturb(h, eps, 0.3, check_finite=False)
    assert torch.equal(out[0], h[0]) and torch.equal(out[2].isnan(), h[2].isnan())
    assert torch.equal(out[2][~h[2].isnan()], h[2][~h[2].isnan()])
    assert torch.equal(out[1], perturb(h[1:2], eps[1:2], 0.3)[0]) and not torch.equal(out[1], h[1])


def test_the_sync_free_assembly_gives_perturb_rows_values() -> None:
    """perturb_selected is perturb_rows' own assembly; sync_free (pinned async copies, no check) changes
    nothing on finite states."""
    torch.manual_seed(0)
    h = torch.randn(2, 5, 16)
    rows = [RowNoise(0.4, NoiseKey(1, 2, 3, 0), 1.0, "rank_one"), RowNoise(0.2, NoiseKey(1, 2, 4, 1), -1.0)]
    mu = torch.linspace(-1, 1, 16)
    ref, _ = perturb_rows(h, rows, last_k=2, steer=mu, sigma_scale=0.5)
    draws = [(rows[0], [1, 0]), (rows[1], [1, 0])]
    for sync_free in (False, True):
        new = perturb_selected(h[:, 3:].reshape(4, 16), draws, steer=mu, sigma_scale=0.5, sync_free=sync_free)
        assert torch.equal(new, ref[:, 3:].reshape(4, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_is_computed_in_float32_and_stays_finite(dtype: torch.dtype) -> None:
    fmax = torch.finfo(dtype).max
    h = torch.full((1, 64), fmax / 2, dtype=dtype)  # ||h|| overflows a naive low-precision norm
    eps = torch.ones(1, 64) * 10
    out = perturb(h, eps, 0.5)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    # the delta itself is computed in float32 from the float32 norm
    delta = calibrated_delta(h, eps, 0.5)
    assert delta.dtype == torch.float32
    expected = 0.5 * (fmax / 2) * math.sqrt(64) / math.sqrt(64) * 10
    torch.testing.assert_close(delta[0, 0], torch.tensor(expected, dtype=torch.float32), rtol=1e-2, atol=0)


def test_sigma_zero_is_the_identity_bitwise() -> None:
    h = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    rows = [RowNoise(0.0, NoiseKey(0, 1, i, 0)) for i in range(3)]
    out, rel = perturb_rows(h, rows)
    assert torch.equal(out, h)
    assert torch.equal(rel, torch.zeros(3))


def test_steering_offset_is_added_in_calibrated_units() -> None:
    d = 9
    h = torch.randn(4, d)
    mu = torch.randn(d)
    delta = calibrated_delta(h, torch.zeros(4, d), 0.0, steer=mu)
    expected = h.norm(dim=-1, keepdim=True) / 3.0 * mu
    torch.testing.assert_close(delta, expected)


# ---------------------------------------------------------------------------------------------
# keyed streams
# ---------------------------------------------------------------------------------------------
def test_same_key_same_noise_and_different_keys_differ() -> None:
    k = NoiseKey(seed=7, step=3, prompt_id=11, draw=2)
    a = draw_eps(k, range(5), 32)
    b = draw_eps(NoiseKey(7, 3, 11, 2), [0, 1, 2, 3, 4], 32)
    assert torch.equal(a, b)
    for other in (NoiseKey(8, 3, 11, 2), NoiseKey(7, 4, 11, 2), NoiseKey(7, 3, 12, 2), NoiseKey(7, 3, 11, 3)):
        assert not torch.equal(a, draw_eps(other, range(5), 32))


def test_subset_of_positions_equals_full_draw_rows() -> None:
    k = NoiseKey(1, 1, 1, 1)
    full = draw_eps(k, range(10), 24)
    assert torch.equal(draw_eps(k, [0], 24), full[:1])
    assert torch.equal(draw_eps(k, [7, 3], 24), full[[7, 3]])


def test_noise_is_device_independent_and_cast_only_at_the_end() -> None:
    k = NoiseKey(1, 2, 3, 4)
    cpu = draw_eps(k, [0, 1], 16)
    meta = draw_eps(k, [0, 1], 16, device="cpu")
    assert torch.equal(cpu, meta)
    if torch.cuda.is_available():  # pragma: no cover - exercised on the GPU machine
        assert torch.equal(draw_eps(k, [0, 1], 16, device="cuda").cpu(), cpu)


def test_noise_seed_is_stable_across_processes() -> None:
    # Pinned value: a change to the hashing scheme would silently change every run's noise.
    assert noise_seed("eps", 0, 1, 2, 3, 0) == noise_seed("eps", 0, 1, 2, 3, 0)
    assert noise_seed("eps", 0, 1, 2, 3, 0) != noise_seed("eps", 0, 1, 2, 3, 1)
    assert noise_seed("a", 1) != noise_seed("a1")
    assert noise_seed(-1) != noise_seed(2**64 - 1)


def test_noise_seed_pinned_value() -> None:
    # blake2b(8) of the canonical encoding, masked to 63 bits; computed once and pinned.
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    h.update(b"s" + (3).to_bytes(4, "little") + b"eps")
    for p in (0, 1, 2, 3, 0):
        h.update(b"i" + p.to_bytes(16, "little", signed=True))
    assert noise_seed("eps", 0, 1, 2, 3, 0) == int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def test_reverse_positions_ignore_padding_side() -> None:
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 1, 0, 0]])
    assert reverse_positions(left).tolist() == [[-1, -1, 2, 1, 0], [4, 3, 2, 1, 0]]
    assert reverse_positions(right).tolist() == [[2, 1, 0, -1, -1]]


def test_padding_and_batch_position_do_not_change_the_noise() -> None:
    d = 16
    torch.manual_seed(0)
    prompt = torch.randn(3, d)  # one prompt's 3 token states
    key = NoiseKey(0, 5, 42, 1)
    # batch A: the prompt alone, no padding; batch B: second row, left-padded by 2, next to another prompt
    a_h = prompt[None]
    b_h = torch.cat([torch.randn(1, 5, d), torch.cat([torch.zeros(2, d), prompt])[None]])
    a_out, _ = perturb_rows(a_h, [RowNoise(0.3, key)])
    b_out, _ = perturb_rows(
        b_h,
        [RowNoise(0.3, NoiseKey(0, 5, 7, 0)), RowNoise(0.3, key)],
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
    )
    assert torch.equal(a_out[0], b_out[1, 2:])
    assert torch.equal(b_out[1, :2], torch.zeros(2, d))  # padding untouched


def test_last_k_fast_path_matches_full_perturbation_on_those_positions() -> None:
    h = torch.randn(2, 6, 32)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    rows = [RowNoise(0.4, NoiseKey(0, 1, 0, 0)), RowNoise(0.4, NoiseKey(0, 1, 1, 0))]
    full, _ = perturb_rows(h, rows, attention_mask=mask)
    fast, _ = perturb_rows(h, rows, attention_mask=mask, last_k=1)
    assert torch.equal(full[:, -1], fast[:, -1])
    assert torch.equal(fast[:, :-1], h[:, :-1])


def test_antithetic_pair_is_an_exact_negation() -> None:
    key = NoiseKey(0, 1, 9, 0)
    h = torch.randn(4, 64)
    eps = draw_eps(key, range(4), 64, mode="antithetic").flip(0)  # rows aligned with tokens
    # the displacements of the two partners are exact (bitwise) negatives
    assert torch.equal(calibrated_delta(h, eps, 0.2 * 1.0), -calibrated_delta(h, eps, 0.2 * -1.0))
    # and perturb_rows applies them: out_+ - h = -(out_- - h) up to the rounding of h + delta
    h2 = h[None].expand(2, 4, 64).clone()
    out, rel = perturb_rows(
        h2, [RowNoise(0.2, key, 1.0, "antithetic"), RowNoise(0.2, key, -1.0, "antithetic")]
    )
    torch.testing.assert_close(out[0] - h, -(out[1] - h), rtol=0, atol=1e-6)
    assert not torch.allclose(out[0], out[1])
    assert rel[0] == pytest.approx(rel[1].item(), rel=1e-5)


def test_rank_one_noise_shares_a_direction_per_step() -> None:
    d = 48
    a = draw_eps(NoiseKey(0, 3, 1, 0), range(4), d, mode="rank_one")
    b = draw_eps(NoiseKey(0, 3, 2, 5), range(2), d, mode="rank_one")
    u = draw_direction(0, 3, d)
    for row in torch.cat([a, b]):
        cos = torch.nn.functional.cosine_similarity(row, u, dim=0).abs()
        assert cos == pytest.approx(1.0, abs=1e-5)
    other_step = draw_eps(NoiseKey(0, 4, 1, 0), [0], d, mode="rank_one")[0]
    assert torch.nn.functional.cosine_similarity(other_step, u, dim=0).abs() < 0.9


def test_rank_one_noise_is_calibrated_in_expectation() -> None:
    d, n = 64, 3000
    # E ||r u||^2 = E r^2 E||u||^2 = d, averaging over steps (fresh u) and prompts (fresh r)
    sq = torch.stack(
        [draw_eps(NoiseKey(0, i, i, 0), [0], d, mode="rank_one")[0].pow(2).sum() for i in range(n)]
    )
    # Var(r^2 ||u||^2) = E r^4 E||u||^4 - d^2 = 3 (d^2 + 2d) - d^2
    se = math.sqrt((3 * (d * d + 2 * d) - d * d) / n)
    assert abs(sq.mean().item() - d) < 5 * se


def test_relative_perturbation_recorded_per_row() -> None:
    d = 4096
    h = torch.randn(3, 2, d)
    out, rel = perturb_rows(
        h, [RowNoise(0.0), RowNoise(0.2, NoiseKey(0, 1, 1, 0)), RowNoise(0.5, NoiseKey(0, 1, 2, 0))]
    )
    assert rel[0] == 0
    # ||delta|| / ||h|| = sigma * ||eps|| / sqrt(d), which concentrates at sigma (sd ~ sigma / sqrt(2d))
    assert rel[1].item() == pytest.approx(0.2, abs=5 * 0.2 / math.sqrt(2 * d))
    assert rel[2].item() == pytest.approx(0.5, abs=5 * 0.5 / math.sqrt(2 * d))
    assert torch.equal(out[0], h[0])


def test_perturb_rows_validates_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[B, T, d\]"):
        perturb_rows(torch.zeros(2, 3), [RowNoise(), RowNoise()])
    with pytest.raises(ValueError, match="RowNoise entries"):
        perturb_rows(torch.zeros(2, 3, 4), [RowNoise()])


# ---------------------------------------------------------------------------------------------
# eq. (6): SPSA
# ---------------------------------------------------------------------------------------------
def test_spsa_gradient_is_eq6() -> None:
    u = torch.tensor([1.0, -2.0, 0.5])
    g = spsa_gradient([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0], 0.25, u)
    # (mean R+ - mean R-) / (2 sigma) * u = (0.75 - 0.25) / 0.5 * u
    torch.testing.assert_close(g, 1.0 * u)
    # per-pair scalars weight each gap; all-ones reproduces eq. (6)
    torch.testing.assert_close(
        spsa_gradient([1, 0], [0, 0], 0.25, u, r=[1.0, 1.0]), spsa_gradient([1, 0], [0, 0], 0.25, u)
    )
    torch.testing.assert_close(spsa_gradient([1, 0], [0, 0], 0.25, u, r=[-2.0, 1.0]), -2.0 * u)
    assert torch.equal(spsa_gradient([1.0], [0.0], 0.0, u), torch.zeros(3))  # sigma annealed to 0


def test_spsa_gradient_recovers_a_linear_reward_direction() -> None:
    # reward response phi(eps) = a . eps: the SPSA estimate averaged over draws is sigma-free and -> a
    torch.manual_seed(0)
    d, n, sigma = 6, 20000, 0.1
    a = torch.randn(d)
    us = torch.randn(n, d)
    gaps = (a * sigma * us).sum(-1) - (a * -sigma * us).sum(-1)  # R+ - R-
    est = torch.stack([spsa_gradient(gaps[i : i + 1], torch.zeros(1), sigma, us[i]) for i in range(0, n, 10)])
    assert torch.nn.functional.cosine_similarity(est.mean(0), a, dim=0) > 0.95


def test_projection_and_update() -> None:
    mu = torch.tensor([3.0, 4.0])
    torch.testing.assert_close(project_ball(mu, 1.0), torch.tensor([0.6, 0.8]))
    assert torch.equal(project_ball(mu, 10.0), mu)
    new = spsa_update(torch.zeros(2), torch.tensor([30.0, 40.0]), lr=0.1, mu_max=2.0)
    torch.testing.assert_close(new.norm(), torch.tensor(2.0))
    # a bounded step keeps its direction and is cut to max_step; a small one is untouched
    new = spsa_update(torch.zeros(2), torch.tensor([30.0, 40.0]), lr=0.1, mu_max=2.0, max_step=0.5)
    torch.testing.assert_close(new, torch.tensor([0.3, 0.4]))
    small = spsa_update(torch.zeros(2), torch.tensor([0.3, 0.4]), lr=0.1, mu_max=2.0, max_step=0.5)
    torch.testing.assert_close(small, torch.tensor([0.03, 0.04]))
    with pytest.raises(ValueError):
        project_ball(mu, -1.0)


# ---------------------------------------------------------------------------------------------
# eq. (4): agreement kernel
# ---------------------------------------------------------------------------------------------
def test_agreement_kernel_eq4() -> None:
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    k = agreement_kernel(x)
    d2 = torch.tensor([[0, 25, 0], [25, 0, 25], [0, 25, 0]], dtype=torch.float32)
    tau2 = (25 * 4) / 6  # RMS^2 of the 6 off-diagonal distances
    torch.testing.assert_close(k, torch.exp(-d2 / (2 * tau2)))
    assert torch.equal(agreement_kernel(torch.ones(3, 2)), torch.ones(3, 3))
    torch.testing.assert_close(agreement_kernel(x, tau=5.0)[0, 1], torch.tensor(math.exp(-0.5)))
    with pytest.raises(ValueError):
        agreement_kernel(torch.ones(1, 4))


def test_depth_decayed_sigmas() -> None:
    assert depth_decayed_sigmas([4, 10, 7], 0.5) == {10: 1.0, 7: 0.5, 4: 0.25}
    with pytest.raises(ValueError):
        depth_decayed_sigmas([1, 1], 0.5)
    with pytest.raises(ValueError):
        depth_decayed_sigmas([1], 0.0)
