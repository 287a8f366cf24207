"""``image``: NoisyRollout's image noise. The noisy half generates from images put through the diffusion
forward process at ``t = int(image_noise_step * decay_k)`` (:meth:`ncgrpo.core.schedule.Schedule.image_t`),
one distorted copy per prompt shared by its noisy half, as NoisyRollout does; TRL builds the loss inputs
from the clean images. :mod:`ncgrpo.core.image_noise` is the math; this module puts it into a generation
(transformers: the noisy rows' ``pixel_values``; vLLM: the noisy rows' PIL images)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed
from ncgrpo.core.plan import RowPlan
from ncgrpo.methods.base import RolloutMethod, TrainerView, register_method


@register_method
class Image(RolloutMethod):
    name = "image"
    target_refusal = (
        "its noise is in the pixels (NoisyRollout's diffusion step t), whose effect on the first token the "
        "LM head alone cannot measure"
    )
    summary = "NoisyRollout: the noisy half generates from diffused copies of the images"
    label = "NoisyRollout (image)"
    slug = "image"
    key_rule = "prompt"
    anneals = "the image distortion step stays near image_noise_step"

    def card_noise(self, args: Any, schedule: str) -> list[str]:
        return [f"image_noise_step {args.image_noise_step} (t = image_noise_step * decay_k)", schedule]

    vllm_server_refusal = (
        "TRL's server path sends the image features of each group's first row (all_images[::num_generations]) "
        "for the whole group, so the noisy rows' distorted images would never reach the server and they would "
        "silently generate from the clean image. Use vllm_mode='colocate' or use_vllm=False for the image method."
    )
    verl_refusal = (
        "NoisyRollout's image noise distorts the noisy half's pixels before vLLM's processor; on verl that "
        "is NoisyRollout's own EasyR1 fork (a data-pipeline change, not a rollout spec). Use ncgrpo's TRL trainer "
        "for the image baseline"
    )

    def begin_generation(
        self, tr: TrainerView, gen: Any, k: int, K: int, prompt_ids: Any, multimodal_fields: dict
    ) -> None:
        """``gen.method_values["image_t"]``: this generation's diffusion step."""
        gen.sigma_k = 0.0
        gen.method_values["image_t"] = tr.schedule.image_t(k, K, tr.args.image_noise_step)

    def generation_inputs(self, tr: TrainerView, gen: Any, images: Any, multimodal_fields: dict) -> dict:
        return distort_multimodal_fields(
            tr.processing_class, images, multimodal_fields, gen.plans, gen.method_values["image_t"]
        )

    def vllm_images(self, tr: TrainerView, gen: Any, images: Any) -> Any:
        return distorted_row_images(tr.processing_class, images, gen.plans, gen.method_values["image_t"])

    def metrics(self, tr: TrainerView, gen: Any) -> dict[str, float]:
        return {"image_noise/t": float(gen.method_values["image_t"])}


def _policy(processing_class):
    """The processor's ``smart_resize`` rule; an error naming what is missing where it has none."""
    return ResizePolicy.from_image_processor(processing_class.image_processor)


def distorted_row_images(processing_class, images, plans: list[RowPlan], t: int):
    """Per row, the PIL images vLLM gets: the clean ones on clean rows, NoisyRollout-distorted copies
    (:func:`ncgrpo.core.image_noise.distort_images`: RGB, resized to the processor's patch grid, then
    noised at step ``t``; one copy per prompt, shared by its noisy rows) on noisy rows. The sides are
    already the processor's target, so vLLM's processor resizes them to themselves."""
    if images is None or not any(images):
        raise ValueError("rollout_method='image' needs image prompts; this batch has none")
    if int(t) == 0:
        return images
    policy = _policy(processing_class)
    done: dict[int, list] = {}
    out = []
    for i, p in enumerate(plans):
        row_imgs = [im for im in (images[i] or []) if im is not None]
        if p.noisy and row_imgs:
            if p.prompt_id not in done:
                seed = prompt_image_seed(p.key.seed, p.key.step, p.prompt_id)
                done[p.prompt_id] = distort_images(row_imgs, t, seed, policy)
            out.append(list(done[p.prompt_id]))
        else:
            out.append(images[i])
    return out


def distort_multimodal_fields(
    processing_class, images, multimodal_fields, plans: list[RowPlan], t: int
) -> dict:
    """Replace the noisy rows' ``pixel_values`` (generation only) by NoisyRollout-distorted copies.

    NoisyRollout's order (:func:`ncgrpo.core.image_noise.distort_images`): each clean image is
    converted to RGB and resized exactly as the image processor resizes it, the noise is added to
    those pixels, and the processor then runs with ``do_resize=False``, so the noise is not
    interpolated and the patch grid is the clean one (checked). ``t = 0`` keeps the clean pixels.
    """
    if images is None or "pixel_values" not in multimodal_fields or "image_grid_thw" not in multimodal_fields:
        raise ValueError(
            "rollout_method='image' needs image prompts processed into pixel_values/image_grid_thw "
            "(a Qwen-VL style processor); this batch has none"
        )
    # apply_chat_template may hand these back as arrays/lists; TRL tensorises them the same way
    pv = multimodal_fields["pixel_values"]
    pv = pv if isinstance(pv, torch.Tensor) else torch.tensor(np.array(pv))
    grid = multimodal_fields["image_grid_thw"]
    grid = grid if isinstance(grid, torch.Tensor) else torch.tensor(np.array(grid))
    out = dict(multimodal_fields)
    out["pixel_values"] = pv
    if int(t) == 0:  # fully annealed: the noisy half generates from the clean images
        return out
    image_processor = processing_class.image_processor
    policy = _policy(processing_class)
    sizes = grid.prod(-1).tolist()  # patches per image
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    new_pv = pv.clone()
    img_idx = 0
    done: dict[int, torch.Tensor] = {}  # one distorted copy per prompt, shared by its noisy rows
    for i, p in enumerate(plans):
        row_imgs = [im for im in (images[i] or []) if im is not None]
        if p.noisy and row_imgs:
            lo, hi = offsets[img_idx], offsets[img_idx + len(row_imgs)]
            if p.prompt_id not in done:
                seed = prompt_image_seed(p.key.seed, p.key.step, p.prompt_id)
                proc = image_processor(
                    images=distort_images(row_imgs, t, seed, policy), do_resize=False, return_tensors="pt"
                )
                new_grid = torch.as_tensor(proc["image_grid_thw"])
                if not torch.equal(new_grid.cpu(), grid[img_idx : img_idx + len(row_imgs)].cpu()):
                    raise RuntimeError(
                        f"distorted images have patch grid {new_grid.tolist()}, the clean ones "
                        f"{grid[img_idx : img_idx + len(row_imgs)].tolist()}: the image processor's "
                        f"size rule is not {policy}, so the noisy copy cannot match the clean image"
                    )
                done[p.prompt_id] = torch.as_tensor(proc["pixel_values"]).to(new_pv.dtype)
            new_pv[lo:hi] = done[p.prompt_id]
        img_idx += len(row_imgs)
    out["pixel_values"] = new_pv
    return out
