"""Group rollout: P prompts -> P groups of G = 2n completions, n clean + n noisy (algorithm lines 2-7).

A rollout without the trainer (benchmarks, notebooks, the library page): a rollout method
(:mod:`ncgrpo.methods`) driven through the transformers engine (:mod:`ncgrpo.engines`). It sits
above both, beside the trainer (the other user of a method), so the engines import nothing above
them (tests/test_layers.py).

All 2n*P rows go through ONE ``generate`` call (prompts duplicated 2n times, as TRL's GRPOTrainer
does for vanilla GRPO), with :func:`ncgrpo.engines.transformers.prefill_noise` flagging the noisy
rows. That is what makes NC-GRPO cost the same as vanilla GRPO at the same G: the only extra work is
the hook body at prefill (eq. 2 on the rows that need it). With ``share_prompt_prefill`` (default) it
costs less: the clean cache is the same for every branch (section 3.1), so each prompt's vision tower
and prompt minus its last token run once and the 2n rows branch at the last prompt token
(:func:`ncgrpo.engines.shared_prefill.shared_prefill_generate`).

Rows are ordered prompt-major: ``[p0 clean x n, p0 noisy x n, p1 clean x n, p1 noisy x n, ...]``.

The rows come from the one row plan (:func:`ncgrpo.core.plan.plan_group`, built on
:func:`~ncgrpo.core.plan.plan_rows`), the same the TRL trainer and every engine use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ncgrpo.core.noise import NoiseKey
from ncgrpo.core.plan import plan_group, prompt_noise_id, sampling_seed
from ncgrpo.engines.branch_point import cut_after_eos, eos_token_ids, unwrap_model
from ncgrpo.engines.shared_prefill import (
    share_prompt_prefill as sharing,  # the parameter of that name says whether to share
)
from ncgrpo.engines.transformers import PrefillRecord, Site, prefill_noise
from ncgrpo.methods import RolloutMethod, get_method, methods
from ncgrpo.models import tokenizer_of

__all__ = ["GroupRollout", "RowMeta", "generate_groups"]

Prompt = str | list[dict[str, Any]]


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowMeta:
    """One completion's place in its group and the noise it departed from.

    ``branch``: 0..2n-1 within the group (clean 0..n-1, noisy n..2n-1); ``noisy``: in the noisy half
    (even when ``sigma`` annealed to 0); ``key``/``sign``: the draw (antithetic partners share a key
    and differ in sign); ``rel``: measured ``||h~ - h|| / ||h||`` at the site (0 on clean rows);
    ``first_token``: the first generated token id.
    """

    prompt_index: int
    prompt_id: int
    branch: int
    noisy: bool
    key: NoiseKey | None
    sigma: float
    sign: float
    rel: float
    first_token: int


@dataclass
class GroupRollout:
    """``P`` groups of ``2n`` completions, rows prompt-major. ``sequences``: ``# [R, T + L]`` (prompt
    left-padded to ``T``); ``completion_ids``: per row, up to and including the first EOS."""

    n: int
    prompt_ids: list[int]
    completion_ids: list[list[int]]
    completions: list[str]
    meta: list[RowMeta]
    sequences: torch.Tensor
    prompt_length: int
    record: PrefillRecord | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        return 2 * self.n

    def group(self, p: int) -> slice:
        """Rows of prompt ``p``."""
        return slice(p * 2 * self.n, (p + 1) * 2 * self.n)


# --------------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------------
def _prompt_text(processor, prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def _as_image_list(img) -> list:
    if img is None:
        return []
    if isinstance(img, (list, tuple)):
        return list(img)
    return [img]


def generate_groups(
    model,
    processor,
    prompts: Sequence[Prompt],
    images: Sequence[Any] | None = None,
    *,
    n: int,
    sigma: float,
    step: int,
    seed: int,
    prompt_ids: Sequence[int] | None = None,
    method: str | RolloutMethod = "latent",
    site: Site = "final_norm",
    layer_decay: float = 0.5,
    steer: torch.Tensor | None = None,
    positions: Literal["auto", "all"] = "auto",
    generation_config=None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    do_sample: bool = True,
    use_hook: bool = True,
    share_prompt_prefill: bool = True,
    timing: bool = False,
    **generate_kwargs: Any,
) -> GroupRollout:
    """Sample ``2n`` completions per prompt: ``n`` from the clean prefill, ``n`` from a perturbed one.

    Algorithm lines 2-7: line 2 is the clean half; lines 4-5 are the hook (eq. 2 on the returned
    last-layer prefill states, KV cache clean); lines 6-7 are ordinary sampling/decoding in the same
    ``generate`` call. ``prompts``: text strings (used verbatim) or chat messages (rendered with the
    processor's chat template); ``images``: per prompt None, an image, or a list of images.
    ``prompt_ids``: stable integers naming the prompts (dataset indices); default
    :func:`~ncgrpo.core.plan.prompt_noise_id` of the tokens (identical prompts then share noise).
    ``method``: ``latent`` (independent draws), ``antithetic`` (``(+eps, -eps)`` pairs) or ``spsa``
    (antithetic rank-one pairs; pass the steering vector as ``steer``). Sampling is seeded from
    ``(seed, step)``, so the same inputs give the same completions. ``use_hook=False`` runs the same
    batch with no hook (the vanilla-GRPO baseline at the same G, for benchmarks).
    ``share_prompt_prefill``: the vision tower and the prompt minus its last token run once per prompt
    and the ``2n`` rows decode from the expanded cache
    (:func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate`; not at layer sites or with
    ``positions="all"``, which need every row's own prefill); ``False``: one prefill per row, as TRL.
    ``GroupRollout.extra["shared_prefill"]`` holds what the call did.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1 (G = 2n completions per prompt), got {n}")
    method = get_method(method)
    if not method.hidden_noise:
        raise ValueError(
            "generate_groups injects hidden-state noise: method must be one of "
            f"{sorted(m.name for m in methods() if m.hidden_noise)}, got {method.name!r} (the other methods run "
            "through NCGRPOTrainer)"
        )
    method.check_group_size(2 * n, field="2n")
    P = len(prompts)
    if P == 0:
        raise ValueError("no prompts")
    if images is not None and len(images) != P:
        raise ValueError(f"got {len(images)} image entries for {P} prompts")
    if prompt_ids is not None and len(prompt_ids) != P:
        raise ValueError(f"got {len(prompt_ids)} prompt_ids for {P} prompts")
    G = 2 * n
    gen_model = unwrap_model(model)
    device = next(gen_model.parameters()).device
    tokenizer = tokenizer_of(processor)

    # ---- inputs: each prompt duplicated G times (prompt-major), left-padded -----------------------
    texts = [_prompt_text(processor, p) for p in prompts]
    image_lists = [_as_image_list(images[i]) if images is not None else [] for i in range(P)]
    rep_texts = [t for t in texts for _ in range(G)]
    old_side = getattr(tokenizer, "padding_side", "left")
    tokenizer.padding_side = "left"
    try:
        if any(image_lists):
            rep_images = [img for imgs in image_lists for _ in range(G) for img in imgs]
            if not all(image_lists):
                raise ValueError("mixing prompts with and without images in one call is not supported")
            inputs = processor(text=rep_texts, images=rep_images, padding=True, return_tensors="pt")
        else:
            inputs = tokenizer(rep_texts, padding=True, return_tensors="pt", add_special_tokens=False)
    finally:
        tokenizer.padding_side = old_side
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in dict(inputs).items()}
    input_ids, mask = inputs["input_ids"], inputs["attention_mask"]
    T = input_ids.shape[1]

    if prompt_ids is None:
        prompt_ids = [
            prompt_noise_id(input_ids[p * G][mask[p * G].bool()].tolist(), image_lists[p]) for p in range(P)
        ]
    prompt_ids = [int(x) for x in prompt_ids]
    rows = [r for pid in prompt_ids for r in plan_group(n, sigma, seed, step, pid, method)]

    # ---- one generate call -------------------------------------------------------------------------
    gen_kw: dict[str, Any] = dict(generate_kwargs)
    gen_kw["do_sample"] = do_sample
    if generation_config is not None:
        gen_kw["generation_config"] = generation_config
    if max_new_tokens is not None:
        gen_kw["max_new_tokens"] = max_new_tokens
    if temperature is not None:
        gen_kw["temperature"] = temperature
    if top_p is not None:
        gen_kw["top_p"] = top_p
    gen_kw["return_dict_in_generate"] = True

    rng_devices = [device] if device.type == "cuda" else []
    record = None
    with torch.random.fork_rng(devices=rng_devices), sharing(gen_model, share_prompt_prefill) as calls:
        torch.manual_seed(sampling_seed(seed, step))
        with torch.no_grad():
            if use_hook:
                with prefill_noise(
                    gen_model,
                    rows,
                    site=site,
                    layer_decay=layer_decay,
                    steer=steer,
                    positions=positions,
                    timing=timing,
                ) as hook:
                    out = gen_model.generate(**inputs, **gen_kw)
                record = hook.last
            else:
                out = gen_model.generate(**inputs, **gen_kw)
    shared = calls[-1] if calls else None
    sequences = out.sequences  # [R, T + L]

    # ---- per-row results --------------------------------------------------------------------------
    completion_ids = cut_after_eos(sequences[:, T:].tolist(), eos_token_ids(gen_model, generation_config))
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)

    rel = record.rel.tolist() if record is not None else [0.0] * len(rows)
    meta = []
    for r, spec in enumerate(rows):
        p, b = divmod(r, G)
        meta.append(
            RowMeta(
                prompt_index=p,
                prompt_id=prompt_ids[p],
                branch=b,
                noisy=b >= n,
                key=spec.key,
                sigma=float(spec.sigma) if use_hook else 0.0,
                sign=float(spec.sign),
                rel=float(rel[r]),
                first_token=int(sequences[r, T]) if sequences.shape[1] > T else -1,
            )
        )
    return GroupRollout(
        n=n,
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        completions=completions,
        meta=meta,
        sequences=sequences,
        prompt_length=T,
        record=record,
        extra={"shared_prefill": shared},
    )
