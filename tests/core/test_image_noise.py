"""NoisyRollout's image distortion (ncgrpo.core.image_noise): schedule, forward process, keyed draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from ncgrpo.core.image_noise import (
    NUM_DIFFUSION_STEPS,
    ResizePolicy,
    alphas_cumprod,
    betas,
    diffuse,
    diffuse_images,
    distort_images,
    pil_to_tensor,
    prompt_image_seed,
    resize_to_target,
    tensor_to_pil,
)
from ncgrpo.core.schedule import image_noise_t, sigma_schedule


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


# -------------------------------------------------------- NoisyRollout's order: RGB, resize, noise
# A small pixel budget keeps the tests fast; the rule is the one the 7B recipe uses at 262144..1e6.
POLICY = ResizePolicy(min_pixels=112 * 112, max_pixels=200 * 200, factor=28)
SIZES = {"smaller": (40, 30), "within": (150, 120), "larger": (400, 300)}  # (width, height)


def _pil_processor(policy: ResizePolicy = POLICY):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=policy.min_pixels, max_pixels=policy.max_pixels, patch_size=14, merge_size=2
    )


def _textured(size: tuple[int, int], mode: str, seed: int = 0) -> Image.Image:
    """Smooth gradients plus a few random blocks, in mode ``L``, ``RGB`` or opaque ``RGBA``."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    base = np.stack([(xx * 255 / w), (yy * 255 / h), ((xx + yy) * 127 / (w + h) + 64)], axis=-1)
    for _ in range(4):
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        base[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, 3)
    rgb = Image.fromarray(base.clip(0, 255).astype(np.uint8))
    if mode == "L":
        return rgb.convert("L")
    if mode == "RGBA":
        return rgb.convert("RGBA")  # alpha 255 everywhere
    return rgb


def _noisyrollout_reference(image: Image.Image, t: int, seed: int) -> Image.Image:
    """NoisyRollout's transform written from its code, independently of ncgrpo.core.image_noise.

    ``verl/utils/dataset.py: process_image`` resizes (PIL's default filter, bicubic) and then converts
    to RGB; the processor's ``smart_resize`` (taken from transformers here) decides the size the model
    sees. ``verl/utils/image_aug.py``: ``ToTensor``, ``q_x`` with betas ``sigmoid(linspace(-6, 6, 1000))
    * (0.5e-2 - 1e-5) + 1e-5``, clamp to [0, 1], ``ToPILImage`` (``mul(255).byte()``). The only change:
    ``randn_like`` draws from a generator seeded with ``seed`` so the comparison is exact.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(
        image.height, image.width, factor=28, min_pixels=POLICY.min_pixels, max_pixels=POLICY.max_pixels
    )
    if (w, h) != image.size:
        image = image.resize((w, h))
    if image.mode != "RGB":
        image = image.convert("RGB")
    x0 = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0
    b = torch.sigmoid(torch.linspace(-6, 6, 1000)) * (0.5e-2 - 1e-5) + 1e-5
    abar = torch.cumprod(1 - b, dim=0)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    x = torch.clamp(torch.sqrt(abar)[t] * x0 + torch.sqrt(1 - abar)[t] * noise, 0.0, 1.0)
    return Image.fromarray(x.mul(255).byte().permute(1, 2, 0).numpy())


def _noise_stats(noisy: np.ndarray, clean: np.ndarray) -> tuple[float, float, float]:
    """(neighbour correlation, std, R-G channel correlation) of ``noisy - clean``, ``# [C, H, W]``."""
    d = noisy.astype(np.float64) - clean.astype(np.float64)

    def corr(a, b):
        return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])

    nb = 0.5 * (corr(d[:, :, :-1], d[:, :, 1:]) + corr(d[:, :-1, :], d[:, 1:, :]))
    return nb, float(d.std()), corr(d[0], d[1])


@pytest.mark.parametrize("where", sorted(SIZES))
@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
@pytest.mark.parametrize("t", [250, 500])
def test_distort_images_matches_noisyrollout_reference(where: str, mode: str, t: int) -> None:
    img = _textured(SIZES[where], mode)
    seed = prompt_image_seed(3, step=7, prompt_id=11)
    (ours,) = distort_images([img], t, [seed], POLICY)
    ref = _noisyrollout_reference(img, t, seed)
    assert ours.mode == "RGB" and ours.size == ref.size
    w, h = ours.size
    assert w % 28 == 0 and h % 28 == 0 and POLICY.min_pixels <= w * h <= POLICY.max_pixels
    assert np.array_equal(np.asarray(ours), np.asarray(ref))


def test_resize_policy_is_the_processors_smart_resize() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    policies = [POLICY, ResizePolicy(262144, 1_000_000, 28), ResizePolicy(3136, 12845056, 28)]
    policies.append(ResizePolicy(32 * 32, 256 * 256, 32))  # Qwen3-VL's 16-pixel patches
    for pol in policies:
        for h, w in [(30, 40), (220, 300), (600, 800), (1200, 1600), (27, 29), (1000, 13), (4000, 3000)]:
            assert pol.target(h, w) == smart_resize(
                h, w, factor=pol.factor, min_pixels=pol.min_pixels, max_pixels=pol.max_pixels
            ), (pol, h, w)
    assert ResizePolicy.from_image_processor(_pil_processor()) == POLICY
    with pytest.raises(ValueError, match="does not expose"):
        ResizePolicy.from_image_processor(object())
    with pytest.raises(ValueError, match="bad resize policy"):
        ResizePolicy(min_pixels=100, max_pixels=10, factor=28)


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA-translucent", "P"])
def test_t0_gives_exactly_the_processors_clean_pixels(mode: str) -> None:
    # the noisy copy is the clean image the model sees plus noise: at t=0 the processor without its
    # resize must give the same pixel_values as the processor on the original image (alpha is
    # composited on white as the processor does)
    ip = _pil_processor()
    for size in SIZES.values():
        img = _textured(size, "RGB")
        if mode == "RGBA-translucent":
            img = img.convert("RGBA")
            img.putalpha(
                Image.fromarray(np.tile(np.linspace(0, 255, size[0]).astype(np.uint8), (size[1], 1)))
            )
        elif mode != "RGB":
            img = img.convert(mode)
        (resized,) = distort_images([img], 0, 0, POLICY)
        clean = ip(images=[img], return_tensors="np")
        again = ip(images=[resized], do_resize=False, return_tensors="np")
        assert np.array_equal(again["image_grid_thw"], clean["image_grid_thw"])
        assert np.array_equal(again["pixel_values"], clean["pixel_values"])


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
def test_resize_to_target_is_distort_images_resize_and_leaves_a_target_sized_image_alone(mode: str) -> None:
    # the trainer sends vLLM resize_to_target's copy and the image method distort_images': the clean
    # pixels of both must be the ones the processor's resize gives
    for size in SIZES.values():
        img = _textured(size, mode)
        out = resize_to_target(img, POLICY)
        assert out.size[::-1] == POLICY.target(img.height, img.width) and out.mode == "RGB"
        (clean,) = distort_images([img], 0, 0, POLICY)
        assert out.tobytes() == clean.tobytes()
    at_target = _textured((140, 112), mode)  # 112 x 140: multiples of 28 within the budget
    assert resize_to_target(at_target, POLICY) is at_target


@pytest.mark.parametrize("where", sorted(SIZES))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_noise_is_per_pixel_and_per_channel_at_the_models_resolution(where: str, mode: str) -> None:
    # mid-grey: the clean image is constant, so the difference is the noise alone. Distorting the
    # original before the processor resizes it gave neighbour correlation 0.70 (upsampled), std 0.21
    # instead of 0.36 (downsampled) and channel correlation 1.00 for L images.
    img = Image.new(mode, SIZES[where], 128 if mode == "L" else (128, 128, 128))
    (clean_img,) = distort_images([img], 0, 0, POLICY)
    (noisy_img,) = distort_images([img], 500, 1, POLICY)
    clean = np.asarray(clean_img).transpose(2, 0, 1) / 255.0
    assert clean.shape[0] == 3 and np.all(clean == 128 / 255)
    noisy = np.asarray(noisy_img).transpose(2, 0, 1) / 255.0
    nb, sd, ch = _noise_stats(noisy, clean)
    assert abs(nb) < 0.03 and abs(ch) < 0.03
    # std of clamp(0.863 * 0.502 + 0.505 * eps, 0, 1) after truncation to 1/255 steps, by quadrature
    abar = alphas_cumprod()[500].item()
    z = np.linspace(-8, 8, 200001)
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    v = np.floor(np.clip(math.sqrt(abar) * 128 / 255 + math.sqrt(1 - abar) * z, 0, 1) * 255) / 255
    m1 = np.trapezoid(v * pdf, z)
    expected_sd = math.sqrt(np.trapezoid(v**2 * pdf, z) - m1**2)
    assert sd == pytest.approx(expected_sd, rel=0.03)
