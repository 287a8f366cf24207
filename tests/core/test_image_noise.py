"""NoisyRollout's image distortion (ncgrpo.core.image_noise): schedule, forward process, keyed draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from ncgrpo.core.image_noise import (
    NUM_DIFFUSION_STEPS,
    alphas_cumprod,
    betas,
    diffuse,
    diffuse_images,
    image_noise_t,
    pil_to_tensor,
    prompt_image_seed,
    tensor_to_pil,
)
from ncgrpo.core.noise import sigma_schedule


def _image(seed: int = 0, size: tuple[int, int] = (56, 48), mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))


# ------------------------------------------------------------------------------------- schedule
def test_betas_match_noisyrollout_formula() -> None:
    b = betas()
    assert b.shape == (NUM_DIFFUSION_STEPS,)
    # endpoints: sigmoid(-6) and sigmoid(6) mapped into [1e-5, 5e-3]
    lo = 1 / (1 + math.exp(6)) * (5e-3 - 1e-5) + 1e-5
    hi = 1 / (1 + math.exp(-6)) * (5e-3 - 1e-5) + 1e-5
    assert b[0].item() == pytest.approx(lo, rel=1e-5)
    assert b[-1].item() == pytest.approx(hi, rel=1e-5)
    assert torch.all(b[1:] > b[:-1])  # increasing
    # abar is the running product of (1 - beta), checked against a float64 loop
    abar = alphas_cumprod()
    ref = np.cumprod(1.0 - b.double().numpy())
    np.testing.assert_allclose(abar.double().numpy(), ref, rtol=1e-5)
    assert torch.all(abar[1:] < abar[:-1])


def test_t500_coefficients_match_anchor() -> None:
    # anchors.md: "t=500 gives roughly 0.863 * x0 + 0.505 * eps"
    abar = alphas_cumprod()[500].item()
    assert math.sqrt(abar) == pytest.approx(0.863, abs=5e-4)
    assert math.sqrt(1 - abar) == pytest.approx(0.505, abs=5e-4)


def test_schedule_accessors_return_copies() -> None:
    b = betas()
    b[0] = 123.0
    assert betas()[0].item() != 123.0


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (1, 499),  # decay is 1 - 2e-8, and int() truncates: NoisyRollout gives 499 too
        (20, 499),
        (40, 250),  # decay exactly 0.5 at k_mid
        (50, 3),
        (60, 0),
    ],
)
def test_image_noise_t_geo3k_schedule(step: int, expected: int) -> None:
    assert image_noise_t(step, 60, 500) == expected


def test_image_noise_t_decay_near_one_at_step_20() -> None:
    decay = sigma_schedule(20, 60, 1.0, kind="sigmoid", gamma=30, k_mid=40)
    assert decay == pytest.approx(1.0, abs=1e-4)
    assert image_noise_t(20, 60, 500) >= 499


def test_image_noise_t_other_kinds_and_validation() -> None:
    assert image_noise_t(30, 60, 500, kind="linear") == 250
    assert image_noise_t(59, 60, 450, kind="constant") == 450
    with pytest.raises(ValueError, match="image_noise_step"):
        image_noise_t(1, 60, 1000)
    with pytest.raises(ValueError, match="unknown schedule"):
        image_noise_t(1, 60, 500, kind="cosine")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- forward process
def test_t0_is_identity() -> None:
    x = torch.rand(3, 8, 9, generator=torch.Generator().manual_seed(0))
    out = diffuse(x, 0, torch.Generator().manual_seed(1))
    assert torch.equal(out, x)
    img = _image()
    (back,) = diffuse_images([img], 0, seed=5)
    assert np.array_equal(np.asarray(back), np.asarray(img))


def test_diffuse_matches_closed_form_and_clamps() -> None:
    x = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
    t = 500
    out = diffuse(x, t, torch.Generator().manual_seed(7))
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    abar = alphas_cumprod()[t].item()
    ref = (math.sqrt(abar) * x + math.sqrt(1 - abar) * eps).clamp(0, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert out.min().item() >= 0.0 and out.max().item() <= 1.0
    # the clamp is active: with std ~0.5 noise some pixels leave [0, 1] before clamping
    raw = math.sqrt(abar) * x + math.sqrt(1 - abar) * eps
    assert (raw < 0).any() and (raw > 1).any()
    assert (out == 0).any() and (out == 1).any()


def test_diffuse_statistics() -> None:
    # a constant grey image at t=100: mean sqrt(abar)*0.5, std sqrt(1-abar) (noise std ~0.06, so the
    # clamp at 0 and 1 is ~8 std away and does not bias the moments)
    x = torch.full((1, 256, 256), 0.5)
    out = diffuse(x, 100, torch.Generator().manual_seed(3))
    abar = alphas_cumprod()[100].item()
    assert out.mean().item() == pytest.approx(math.sqrt(abar) * 0.5, abs=2e-3)
    assert out.std().item() == pytest.approx(math.sqrt(1 - abar), rel=2e-2)


def test_diffuse_rejects_bad_t() -> None:
    with pytest.raises(ValueError, match="diffusion step"):
        diffuse(torch.zeros(1, 2, 2), NUM_DIFFUSION_STEPS)
    with pytest.raises(ValueError, match="diffusion step"):
        diffuse(torch.zeros(1, 2, 2), -1)


def test_diffuse_keeps_shape_and_is_float32() -> None:
    x = torch.rand(2, 3, 5, 7).half()
    out = diffuse(x, 10, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == torch.float32


# ---------------------------------------------------------------------------------- PIL + keys
def test_pil_roundtrip() -> None:
    for mode in ("RGB", "L"):
        img = _image(mode=mode)
        x = pil_to_tensor(img)
        assert x.shape[0] == (3 if mode == "RGB" else 1)
        assert x.min() >= 0 and x.max() <= 1
        back = tensor_to_pil(x)
        assert back.mode == mode and back.size == img.size
        assert np.array_equal(np.asarray(back), np.asarray(img))


def test_rgba_becomes_rgb() -> None:
    img = _image().convert("RGBA")
    (out,) = diffuse_images([img], 300, seed=0)
    assert out.mode == "RGB" and out.size == img.size


def test_diffuse_images_deterministic_and_layout_independent() -> None:
    imgs = [_image(i) for i in range(3)]
    a = diffuse_images(imgs, 400, seed=11)
    b = diffuse_images(imgs, 400, seed=11)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    # explicit per-image seeds: any subset / order reproduces the same images
    seeds = [prompt_image_seed(11, step=3, prompt_id=p) for p in (7, 2, 9)]
    full = diffuse_images(imgs, 400, seeds)
    sub = diffuse_images([imgs[2], imgs[0]], 400, [seeds[2], seeds[0]])
    assert np.array_equal(np.asarray(sub[0]), np.asarray(full[2]))
    assert np.array_equal(np.asarray(sub[1]), np.asarray(full[0]))
    # different seed -> different draw; same image content in different slots -> different noise
    c = diffuse_images(imgs, 400, seed=12)
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))
    twin = diffuse_images([imgs[0], imgs[0]], 400, seed=11)
    assert not np.array_equal(np.asarray(twin[0]), np.asarray(twin[1]))


def test_diffuse_images_does_not_touch_inputs_and_changes_pixels() -> None:
    img = _image()
    before = np.asarray(img).copy()
    (out,) = diffuse_images([img], 500, seed=0)
    assert np.array_equal(np.asarray(img), before)
    diff = np.abs(np.asarray(out, dtype=np.float64) - before).mean() / 255
    assert diff > 0.1  # std ~0.5 noise on [0,1] pixels (clamped) moves pixels a lot


def test_prompt_image_seed_keys() -> None:
    assert prompt_image_seed(0, 1, 2) == prompt_image_seed(0, 1, 2)
    assert len({prompt_image_seed(0, s, p) for s in range(3) for p in range(3)}) == 9


def test_seed_count_mismatch() -> None:
    with pytest.raises(ValueError, match="2 seeds for 1 images"):
        diffuse_images([_image()], 10, [1, 2])
