"""Images in the trainer: the ones vLLM gets, resized to the trainer processor's size (every method;
NoisyRollout's image distortion is the image method's, :mod:`ncgrpo.methods.image`).

Why vLLM's images are resized here. TRL 1.16 tokenises each prompt with the trainer's processor
(``min_pixels`` / ``max_pixels`` of the recipe, e.g. NoisyRollout's 262144 / 1000000), which expands an
image into as many ``<|image_pad|>`` tokens as its resized patch grid has merged patches, and computes
the loss on those tokens; but it hands vLLM the ORIGINAL PIL images (colocate:
``multi_modal_data``; server: ``VLLMClient.image_features``, processed by the server's
``/v1/chat/completions/render``). vLLM's processor resizes them by the checkpoint's own
``preprocessor_config.json`` (Qwen2.5-VL: 3136..12845056 pixels), so a Geometry3K image below 262144
pixels gets fewer image tokens in generation than in the loss: the completion is sampled from another
prompt than the one it is scored on. ``NCGRPOTrainer._generate_single_turn`` resizes every image bound
for vLLM (:func:`engine_row_images`) to exactly the trainer processor's target (:func:`engine_images`).
vLLM's processor applies the same ``smart_resize`` rule; on an image whose sides are already multiples
of ``patch_size * merge_size`` and whose area lies within its limits that rule is the identity, so both
sides see the same size and the same number of image tokens (tests/test_vllm_images.py). That holds
when the trainer's target lies within the engine's limits: any budget inside the checkpoint's own
``[min_pixels, max_pixels]`` (every recipe's: 262144..1e6 within Qwen2.5-VL's 3136..12845056; the
Qwen3-VL recipes keep the checkpoint's own limits).

Not ``mm_processor_kwargs={"min_pixels": .., "max_pixels": ..}`` (vLLM honours it per engine or per
request): TRL 1.16 builds the colocated ``LLM(...)`` with a fixed argument list, so it could only ride on
each request, and in server mode the images are processed by ``trl vllm-serve``'s own processor through
``/v1/chat/completions/render``, called by TRL's client with no such argument; the server's limits are set
where it is launched, which the trainer neither controls nor sees. Resizing in the trainer holds for both
modes and any server whose limits contain the target, and a large image crosses HTTP at the model's size.
Pixels: with transformers' PIL image processors (this CPU's) the engine gets the trainer's pixels bit for
bit (tested); a torchvision-backend processor resizes with its own bicubic kernel, so there the pixels
may differ by interpolation rounding while the size and token count are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ncgrpo.core.image_noise import ResizePolicy, resize_to_target


def engine_images(images: Sequence[Any], policy, done: dict[int, Any] | None = None) -> list:
    """``images`` (PIL) at the size the trainer's processor resizes them to.

    ``policy``: :class:`ncgrpo.core.image_noise.ResizePolicy` of the trainer's image processor. An
    image already at ``policy.target`` is returned as is (the same object: no copy, no re-encode);
    any other one is converted to RGB and resized as the processor does
    (:func:`ncgrpo.core.image_noise.resize_to_target`, the resize of
    :func:`~ncgrpo.core.image_noise.distort_images`, without noise). ``None`` entries stay ``None``.
    ``done`` (``id -> result``, filled in): an image object met before is not resized again, so rows
    sharing an image share one copy. A bad entry: ``TypeError`` / ``ValueError`` naming its index.
    """
    done = {} if done is None else done
    out = []
    for j, image in enumerate(images):
        if id(image) not in done:
            try:
                done[id(image)] = None if image is None else _engine_image(image, policy)
            except (TypeError, ValueError) as e:
                raise type(e)(f"image {j}: {e}") from e
        out.append(done[id(image)])
    return out


def _engine_image(image, policy):
    """One PIL image through :func:`~ncgrpo.core.image_noise.resize_to_target`, refused where vLLM would
    refuse the result."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(
            f"a {type(image).__name__}, not a PIL image; the images sent to vLLM are resized to the trainer "
            "processor's size first, which needs PIL images"
        )
    out = resize_to_target(image, policy)
    if max(out.size) / min(out.size) > 200:  # floor-rounding a near-200:1 image can push it past 200:1
        raise ValueError(
            f"{image.width}x{image.height} resizes to {out.width}x{out.height} for the trainer's processor, an "
            "aspect ratio over 200 that vLLM's processor (smart_resize) refuses; crop or pad it in the data"
        )
    return out


def engine_policy(processing_class):
    """The trainer processor's size rule (:class:`~ncgrpo.core.image_noise.ResizePolicy`), or ``None``
    for a processor without Qwen-VL's ``smart_resize`` rule (no ``patch_size`` / ``merge_size`` / pixel
    limits: a fixed-size processor resizes alike in the trainer and in vLLM)."""
    ip = getattr(processing_class, "image_processor", None)
    if ip is None or getattr(ip, "patch_size", None) is None or getattr(ip, "merge_size", None) is None:
        return None
    return ResizePolicy.from_image_processor(ip)


def engine_row_images(trainer, images):
    """Per row (a list of PIL images, or ``None``), :func:`engine_images` under the trainer processor's
    policy (:func:`resize_policy`), an image shared by rows resized once; ``images`` itself when
    every image is at its target already (or the processor has no ``smart_resize`` rule).

    ``NCGRPOTrainer._generate_single_turn`` sends every generation's images through here when
    ``use_vllm``: every method (vanilla included), training and evaluation, tool turns, colocate and
    server mode; TRL uses ``images`` for vLLM only (the loss inputs were built from the originals
    before). The image method's distorted copies are at the target already and pass unchanged.
    Reads ``trainer.processing_class`` (through :func:`resize_policy`)."""
    policy = resize_policy(trainer)
    if policy is None:
        return images
    out, changed = [], False
    done: dict[int, Any] = {}
    for i, row in enumerate(images):
        if not row:
            out.append(row)
            continue
        try:
            new = engine_images(row, policy, done)
        except (TypeError, ValueError) as e:
            raise type(e)(f"row {i}, {e}") from e
        row_changed = any(a is not b for a, b in zip(new, row, strict=True))
        changed = changed or row_changed
        out.append(new if row_changed else row)
    return out if changed else images


def resize_policy(trainer):
    """:func:`engine_policy` of ``trainer.processing_class``, built once per processor (not at every
    generation; cached in ``trainer._nc_policy_of``)."""
    processor = trainer.processing_class
    cached = getattr(trainer, "_nc_policy_of", None)
    if cached is None or cached[0] is not processor:
        cached = trainer._nc_policy_of = (processor, engine_policy(processor))
    return cached[1]
