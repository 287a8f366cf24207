"""NoisyRollout's image distortion: a diffusion-style forward process on pixels (the "image" baseline).

Pure torch/numpy/PIL, no engine imports. NoisyRollout (anchors.md; EasyR1 ``ImageAugmenter``) distorts
the noisy half's images with one step of the DDPM forward process on pixels in [0, 1]::

    betas = sigmoid(linspace(-6, 6, 1000)) * (5e-3 - 1e-5) + 1e-5
    abar  = cumprod(1 - betas)
    x_t   = clamp(sqrt(abar_t) * x0 + sqrt(1 - abar_t) * eps, 0, 1),   eps ~ N(0, I)

at ``t = int(image_noise_step * decay)`` (``image_noise_step`` is their ``gaussian_noise_step``,
alpha_0 in the NoisyRollout paper; 500 for Geometry3K), with ``decay`` the same sigmoid annealing as
eq. (3) of our paper (:func:`ncgrpo.core.schedule.image_noise_t`). ``t=500`` gives
roughly ``0.863 * x0 + 0.505 * eps``.

Two deliberate differences from their code, neither of which changes a distorted image's distribution:

- ``t = 0`` returns the image unchanged. Theirs indexes ``abar[0] = 1 - 1e-5`` and so still adds noise
  of std ~0.003 once the schedule has fully decayed; "decayed to zero" should mean clean.
- Noise is keyed: each image's draw comes from its own CPU generator seeded by
  :func:`ncgrpo.core.noise.noise_seed`, so the distorted copy of a prompt's image is a pure function of
  (run seed, step, prompt id, image index), whatever the batch layout, process count or device.
  Theirs uses the global torch RNG.

Float -> uint8 conversion truncates (``(x * 255).to(uint8)``), as torchvision's ``ToPILImage`` does in
their code.

Order of operations (:func:`distort_images`). NoisyRollout never adds noise to an image the model
will see at another resolution: its dataset (``verl/utils/dataset.py: process_image``) resizes each
image into ``[min_pixels, max_pixels]`` and converts it to RGB when the data are loaded, and
``image_aug.py`` adds the noise to that RGB image, independently per pixel and channel. Distorting
the original and letting the processor resize afterwards instead interpolates the noise: measured at
the model's pixel grid (Qwen2-VL processor, 262144..1e6 pixels, t=500, mid-grey image), neighbouring
pixels' noise correlates 0.70 on a 300x220 image (upsampled ~2x), the noise std falls from 0.29 to
0.21 on a 1600x1200 one (downsampled), and an ``L`` image gets the same noise on all three channels
(correlation 1.00). :func:`distort_images` therefore converts to RGB as the processor does, resizes to
exactly the processor's target (:class:`ResizePolicy`, ``smart_resize``), then adds the noise; the
caller runs the processor with ``do_resize=False``. One small difference from their pipeline: their
vLLM processor still re-rounds each side to a multiple of ``patch_size * merge_size`` after the
noise (e.g. 597x438 -> 588x448), a resample of a few percent that, on the same mid-grey images, leaves
0.16 correlation between neighbours and lowers the noise std to 0.28; here the noise lands on the
model's pixels unresampled (correlation 0.00, std 0.36). RGBA: their ``convert("RGB")``
drops the alpha channel, the Qwen processor that produces our clean images composites it on white;
:func:`to_rgb` follows the processor so the noisy copy is the clean image plus noise (identical for
opaque images).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ncgrpo.core.noise import noise_seed
from ncgrpo.core.schedule import NUM_DIFFUSION_STEPS

__all__ = [
    "NUM_DIFFUSION_STEPS",
    "ResizePolicy",
    "alphas_cumprod",
    "betas",
    "diffuse",
    "diffuse_images",
    "distort_images",
    "pil_to_tensor",
    "prompt_image_seed",
    "resize_to_target",
    "tensor_to_pil",
    "to_rgb",
]

_BETA_MIN = 1e-5
_BETA_MAX = 5e-3


@functools.cache
def _schedule() -> tuple[torch.Tensor, torch.Tensor]:
    b = torch.sigmoid(torch.linspace(-6, 6, NUM_DIFFUSION_STEPS)) * (_BETA_MAX - _BETA_MIN) + _BETA_MIN
    return b, torch.cumprod(1 - b, dim=0)


def betas() -> torch.Tensor:
    """NoisyRollout's 1000 betas: ``sigmoid(linspace(-6, 6, 1000)) * (5e-3 - 1e-5) + 1e-5``. ``# [1000]``"""
    return _schedule()[0].clone()


def alphas_cumprod() -> torch.Tensor:
    """``abar_t = prod_{s <= t} (1 - beta_s)`` (0-based ``t``, as their ``alphas_prod[t]``). ``# [1000]``"""
    return _schedule()[1].clone()


def diffuse(x0: torch.Tensor, t: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """One forward-process draw ``clamp(sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, 0, 1)``; ``t=0`` is identity.

    ``x0``: pixels in [0, 1], ``# [..., H, W]`` (any leading dims, e.g. ``[C, H, W]``). ``eps`` is
    drawn in float32 on ``generator``'s device (CPU by default) and moved to ``x0.device``, so the
    result does not depend on where ``x0`` lives. Returns float32, same shape as ``x0``.
    """
    t = int(t)
    if not 0 <= t < NUM_DIFFUSION_STEPS:
        raise ValueError(f"diffusion step t must be in [0, {NUM_DIFFUSION_STEPS - 1}], got {t}")
    x = x0.float()
    if t == 0:
        return x.clone()
    abar = _schedule()[1][t]  # 0-dim float32: the coefficients are rounded as in their code
    gen_device = generator.device if generator is not None else torch.device("cpu")
    eps = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=gen_device).to(x.device)
    return (abar.sqrt() * x + (1 - abar).sqrt() * eps).clamp_(0.0, 1.0)


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image -> float32 ``# [C, H, W]`` in [0, 1] (``L`` and ``RGB`` kept, other modes -> RGB)."""
    if image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    arr = np.asarray(image, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def tensor_to_pil(x: torch.Tensor) -> Image.Image:
    """Float ``# [C, H, W]`` in [0, 1] (C = 1 or 3) -> PIL, truncating as torchvision's ToPILImage."""

    arr = (x.detach().cpu().float().clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).numpy()
    if arr.shape[2] == 1:
        return Image.fromarray(arr[:, :, 0])
    return Image.fromarray(arr)


def prompt_image_seed(seed: int, step: int, prompt_id: int) -> int:
    """Seed for the distorted copy of one prompt's images at one training step.

    NoisyRollout distorts each prompt once per step and shares that copy across the n noisy
    rollouts, so the key has no branch index. Pass the result to :func:`diffuse_images`.
    """
    return noise_seed("image_noise", seed, step, prompt_id)


def diffuse_images(images: Sequence[Image.Image], t: int, seed: int | Sequence[int]) -> list[Image.Image]:
    """Distort each PIL image with :func:`diffuse` at step ``t``.

    ``seed``: an int (image ``i`` draws from ``noise_seed("image", seed, i)``, so its noise depends on
    its index within ``images`` only, e.g. the prompt's image order; use :func:`prompt_image_seed` to
    key by step and prompt), or one seed per image. ``t=0`` returns copies of the inputs unchanged.
    Non-``L``/``RGB`` images (RGBA, P, ...) come back as RGB.
    """
    images = list(images)
    if isinstance(seed, (int, np.integer)):
        seeds = [noise_seed("image", int(seed), i) for i in range(len(images))]
    else:
        seeds = [int(s) for s in seed]
        if len(seeds) != len(images):
            raise ValueError(f"got {len(seeds)} seeds for {len(images)} images")
    out = []
    for image, s in zip(images, seeds, strict=True):
        if int(t) == 0:
            out.append(image.copy())
            continue
        g = torch.Generator(device="cpu")
        g.manual_seed(s)
        out.append(tensor_to_pil(diffuse(pil_to_tensor(image), t, g)))
    return out


# ------------------------------------------------------------------------ NoisyRollout's order
@dataclass(frozen=True)
class ResizePolicy:
    """The Qwen-VL image processors' size rule: ``smart_resize(h, w, factor, min_pixels, max_pixels)``.

    ``factor = patch_size * merge_size`` (28 for Qwen2/2.5-VL, 32 for Qwen3-VL). Each side is rounded
    to the nearest multiple of ``factor``; if the area then exceeds ``max_pixels`` (falls below
    ``min_pixels``) both sides are scaled down (up) by the same ratio and floored (ceiled) to multiples
    of ``factor``.
    """

    min_pixels: int
    max_pixels: int
    factor: int

    def __post_init__(self) -> None:
        if self.factor < 1 or self.min_pixels < 0 or self.max_pixels < max(self.min_pixels, 1):
            raise ValueError(
                f"bad resize policy: factor={self.factor}, min_pixels={self.min_pixels}, "
                f"max_pixels={self.max_pixels}"
            )

    def target(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` the processor resizes a ``height x width`` image to."""
        f = self.factor
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio must be below 200, got {height}x{width}")
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    @classmethod
    def from_image_processor(cls, image_processor) -> ResizePolicy:
        """Read the policy off a Qwen-VL image processor (PIL or torchvision backend, transformers 4.x/5.x).

        transformers 5 keeps the limits in ``size = {"shortest_edge": min_pixels, "longest_edge":
        max_pixels}``; 4.x also had ``min_pixels`` / ``max_pixels`` attributes, which win when set.
        """
        size = getattr(image_processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        lo = getattr(image_processor, "min_pixels", None) or get("shortest_edge") or get("min_pixels")
        hi = getattr(image_processor, "max_pixels", None) or get("longest_edge") or get("max_pixels")
        patch = getattr(image_processor, "patch_size", None)
        merge = getattr(image_processor, "merge_size", None)
        if lo is None or hi is None or patch is None or merge is None:
            raise ValueError(
                f"{type(image_processor).__name__} does not expose min/max pixels, patch_size and "
                "merge_size (a Qwen-VL style image processor is needed for rollout_method='image')"
            )
        return cls(min_pixels=int(lo), max_pixels=int(hi), factor=int(patch) * int(merge))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the transformers image processors convert: transparency composited on white, else ``convert``."""

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def resize_to_target(image: Image.Image, policy: ResizePolicy) -> Image.Image:
    """``image`` at ``policy.target``, as the Qwen PIL image processor resizes it: the same object when
    it is at its target already, else converted with :func:`to_rgb` and resized with PIL bicubic.
    :func:`distort_images` (on the RGB copy) and the trainer's images for vLLM
    (:func:`ncgrpo.trainer.images.engine_images`) both resize through here."""

    h, w = policy.target(image.height, image.width)
    if (h, w) == (image.height, image.width):
        return image
    return to_rgb(image).resize((w, h), Image.BICUBIC)


def distort_images(
    images: Sequence[Image.Image], t: int, seed: int | Sequence[int], policy: ResizePolicy
) -> list[Image.Image]:
    """NoisyRollout's distortion in its order: RGB, resize to the processor's target, then per-pixel noise.

    Each image is converted with :func:`to_rgb`, resized (PIL bicubic, as the Qwen PIL image processor
    does) to ``policy.target(h, w)``, and distorted with :func:`diffuse_images` (same seeding: an int
    keys image ``i`` by its index, or pass one seed per image). The results are RGB images whose sides
    are multiples of ``policy.factor``: give them to the image processor with ``do_resize=False`` so
    the noise reaches the model's pixels without being interpolated. ``t=0`` returns the resized
    clean images.
    """
    return diffuse_images([resize_to_target(to_rgb(image), policy) for image in images], t, seed)
