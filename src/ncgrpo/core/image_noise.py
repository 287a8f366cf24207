"""NoisyRollout's image distortion: a diffusion-style forward process on pixels (the "image" baseline).

Pure torch/numpy/PIL, no engine imports. NoisyRollout (anchors.md; EasyR1 ``ImageAugmenter``) distorts
the noisy half's images with one step of the DDPM forward process on pixels in [0, 1]::

    betas = sigmoid(linspace(-6, 6, 1000)) * (5e-3 - 1e-5) + 1e-5
    abar  = cumprod(1 - betas)
    x_t   = clamp(sqrt(abar_t) * x0 + sqrt(1 - abar_t) * eps, 0, 1),   eps ~ N(0, I)

at ``t = int(image_noise_step * decay)`` (``image_noise_step`` is their ``gaussian_noise_step``,
alpha_0 in the NoisyRollout paper; 500 for Geometry3K), with ``decay`` the same sigmoid annealing as
eq. (3) of our paper, i.e. :func:`ncgrpo.core.noise.sigma_schedule` with ``sigma0=1``. ``t=500`` gives
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
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ncgrpo.core.noise import ScheduleKind, noise_seed, sigma_schedule

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "NUM_DIFFUSION_STEPS",
    "alphas_cumprod",
    "betas",
    "diffuse",
    "diffuse_images",
    "image_noise_t",
    "pil_to_tensor",
    "prompt_image_seed",
    "tensor_to_pil",
]

#: Length of NoisyRollout's diffusion schedule.
NUM_DIFFUSION_STEPS = 1000
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


def image_noise_t(
    step: int,
    total_steps: int,
    image_noise_step: int = 500,
    *,
    kind: ScheduleKind = "sigmoid",
    gamma: float = 30.0,
    k_mid: float = 40.0,
) -> int:
    """Diffusion step for training step ``step``: ``int(image_noise_step * decay)``.

    ``decay`` is eq. (3)'s factor (``sigma_schedule`` with ``sigma0=1``), NoisyRollout's annealing:
    With gamma=30, k_mid=40, K=60 and image_noise_step=500, t is 499 (decay is just below 1) through
    step ~25, 496 at step 30, 250 at step 40, 3 at step 50 and 0 at step 60.
    """
    if not 0 <= image_noise_step <= NUM_DIFFUSION_STEPS - 1:
        raise ValueError(
            f"image_noise_step must be in [0, {NUM_DIFFUSION_STEPS - 1}], got {image_noise_step}"
        )
    decay = sigma_schedule(step, total_steps, 1.0, kind=kind, gamma=gamma, k_mid=k_mid)
    return int(image_noise_step * decay)


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
    abar = _schedule()[1][t].item()
    gen_device = generator.device if generator is not None else torch.device("cpu")
    eps = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=gen_device).to(x.device)
    return (abar**0.5 * x + (1.0 - abar) ** 0.5 * eps).clamp_(0.0, 1.0)


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
    from PIL import Image

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
