"""The loss side of a GRPO step with each prompt computed once per group (``share_prompt_loss``, issue 24).

TRL 1.16's ``GRPOTrainer._get_per_token_logps_and_entropies`` forwards every row's
``prompt + completion``: the ``G`` rows of a group run the same prompt (and, for a VLM, the same vision
tower pass) ``G`` times in the old-log-prob pass, the reference pass (``beta > 0``) and the loss
forward and its backward. :func:`per_token_logps_and_entropies` computes exactly what that method
returns, with every set of rows that share a prompt forwarded as ONE packed sequence::

    [prompt minus its last token | p_last c_1 | p_last c_2 | ... | p_last c_g]

under a 4-D attention mask: the prompt part is causal, block ``i`` (the prompt's last token followed by
completion ``i``) sees the prompt part and itself causally, never another block. Each token keeps the
position id it has in its own row (arange for text models; Qwen2/2.5/3-VL's 3-D M-RoPE positions from
the model's own ``compute_3d_position_ids`` on the original rows), so each completion token sees the
same keys at the same positions as in the repeated path: only float rounding differs. The prompt's
last token is repeated per block (one token per row) so that every position predicts exactly one
label and TRL's fused LM head (``fused_lm_head=True`` with pre-shifted ``shift_labels``) computes the
log-probabilities and entropies, temperature included, exactly as for the repeated rows.

The formulation has no cache: each packed forward is a pure function of its inputs, so gradient
checkpointing (which recomputes a layer's forward in the backward) is exact, unlike a shared
``DynamicCache`` that a recomputed layer would append to twice.

Rows are grouped within each of TRL's micro-batches (``batch_size`` rows, cut without regard to
groups, shuffled when ``steps_per_generation > 1``): rows whose prompt ids, prompt mask and images
(grid and pixels) are identical form a set; a row alone in its micro-batch is a set of one, which is
the repeated path with a block mask. A set is packed into one sequence, or into a few consecutive
packs when that is cheaper (:func:`split_set`, below). The packs of one micro-batch are forwarded
together, right-padded to the longest (a padding position attends only to itself and scores nothing).

Cost: a pack of ``g`` rows forwards ``Lp = P + g (C + 1) - 1`` tokens instead of ``g (P + C)``, and the
vision tower once instead of ``g`` times. But sdpa and eager attention compute the whole masked
``Lp x Lp`` square (no block skipping), so attention FLOPs grow like ``Lp^2`` where the repeated
path's grow like ``g (P + C)^2``: :func:`split_set` picks the rows per pack that minimise
``Lp * linear + Lp^2 * pair`` FLOPs (plus the vision tower once per pack) from the model's sizes: at
the paper's proportions (G = 12, P = 800 with 600 image tokens, C = 500) one pack for Qwen2.5-VL-3B
and 7B, two at C = 1024, four at C = 2048. Memory: the mask is
``packs x Lp^2`` booleans (sdpa; eager takes it as floats of the model's dtype and materialises the
``heads x Lp^2`` attention weights): at ``P = 800``, ``C = 500``, ``g = 12``, ``Lp = 6,811``, 46 MB as
booleans per pack, where the repeated rows' padding masks need ``12 x 1,300^2`` = 20 MB.

Supported: text decoders with full attention only (Qwen2, Qwen3, Llama) and Qwen2-VL / Qwen2.5-VL /
Qwen3-VL with image prompts, attention implementation ``sdpa`` or ``eager`` (flash attention takes
no 4-D mask; a sliding window would be replaced by the mask). :func:`check_supported` says so before
training starts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn

from ncgrpo.engines.branch_point import unwrap_model

#: model_type -> whether it is a Qwen-VL model with M-RoPE positions (``compute_3d_position_ids``)
SUPPORTED_MODEL_TYPES = {
    "qwen2": False,
    "qwen3": False,
    "llama": False,
    "qwen2_vl": True,
    "qwen2_5_vl": True,
    "qwen3_vl": True,
}
#: attention implementations that honour a 4-D mask (transformers' masking_utils returns it as-is)
SUPPORTED_ATTENTION = ("sdpa", "eager")


def check_supported(model: nn.Module, *, aux_loss: bool = False, what: str = "model") -> None:
    """Raise ``ValueError`` saying what to set when ``share_prompt_loss`` cannot be exact for ``model``."""
    m = unwrap_model(model)
    cfg = m.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"share_prompt_loss=True: the {what}'s model_type {mt!r} is not one it is tested on "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}); set share_prompt_loss=False."
        )
    text = cfg.get_text_config()
    attn = getattr(text, "_attn_implementation", None) or getattr(cfg, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"share_prompt_loss=True needs a 4-D attention mask, which attn_implementation={attn!r} does not "
            f"take; load the {what} with attn_implementation='sdpa' (or 'eager'), or set share_prompt_loss=False."
        )
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(text, "use_sliding_window", False):
        raise ValueError(
            f"share_prompt_loss=True: the {what} uses sliding-window attention ({sorted(layer_types)}), which the "
            "shared-prompt mask would replace; set share_prompt_loss=False."
        )
    if aux_loss:
        raise ValueError(
            "share_prompt_loss=True: the MoE load-balancing loss would be computed over the packed tokens, not "
            "TRL's rows; set share_prompt_loss=False or router_aux_loss_coef=0."
        )


def _positions(model: nn.Module, input_ids, attention_mask, image_grid_thw, mm_token_type_ids):
    """The position ids the repeated forward uses for these rows: ``[B, L]`` or ``[3, B, L]`` (M-RoPE)."""
    m = unwrap_model(model)
    B, L = input_ids.shape
    if SUPPORTED_MODEL_TYPES.get(m.config.model_type):
        backbone = next(x for x in m.modules() if hasattr(x, "compute_3d_position_ids"))
        pos = backbone.compute_3d_position_ids(
            input_ids=input_ids,
            inputs_embeds=None,
            image_grid_thw=image_grid_thw,
            video_grid_thw=None,
            attention_mask=attention_mask,
            past_key_values=None,
            mm_token_type_ids=mm_token_type_ids,
        )
        if pos is None:  # no images: the language model falls back to arange on all three axes
            pos = torch.arange(L, device=input_ids.device).view(1, 1, L).expand(3, B, L)
        return pos
    return torch.arange(L, device=input_ids.device).view(1, L).expand(B, L)


def _placeholder_ids(model: nn.Module) -> set[int]:
    cfg = unwrap_model(model).config
    return {int(v) for k in ("image_token_id", "video_token_id") if (v := getattr(cfg, k, None)) is not None}


def pack_costs(config) -> tuple[float, float, float]:
    """Forward FLOPs per text layer of: one token through the linear layers (the LM head spread over the
    layers), one query-key pair of attention (``QK^T`` and ``AV``), and one image patch through the
    vision tower (0 for a text model; its attention ignored)."""
    t = config.get_text_config()
    d, h, kv = t.hidden_size, t.num_attention_heads, t.num_key_value_heads
    hd = getattr(t, "head_dim", None) or d // h
    layers = t.num_hidden_layers
    linear = (
        2 * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * t.intermediate_size) + 2 * d * t.vocab_size / layers
    )
    v = getattr(config, "vision_config", None)
    vision = 0.0
    if v is not None:
        vd = getattr(v, "hidden_size", None) or getattr(v, "embed_dim", 0)
        vi = getattr(v, "intermediate_size", None) or int(vd * getattr(v, "mlp_ratio", 4))
        vision = getattr(v, "depth", 0) * 2 * (4 * vd * vd + 3 * vd * vi) / layers
    return float(linear), float(4 * h * hd), float(vision)


def split_set(
    rows: list[int],
    prompt_tokens: int,
    kept,
    costs: tuple[float, float, float],
    pack_rows: int | None = None,
    patches: int = 0,
) -> list[list[int]]:
    """``rows`` (one shared prompt) in consecutive packs of ``k`` rows, ``k`` minimising the packs' FLOPs.

    A pack of ``Lp = prompt_tokens + sum(kept_i + 1)`` tokens costs ``Lp * linear + Lp^2 * pair`` plus
    the vision tower on the prompt's ``patches``: the attention runs over the whole masked square, so
    with long completions one pack of all ``g`` rows can cost more than a few packs that each repeat the
    prompt. ``k = 1`` is the repeated path (TRL's forward, counted with a causal half square). Ties go
    to the larger ``k``. ``pack_rows`` fixes ``k``.
    """
    g = len(rows)
    if pack_rows is not None:
        k = max(1, min(int(pack_rows), g))
        return [rows[i : i + k] for i in range(0, g, k)]
    linear, pair, vision = costs
    best = None
    for k in range(g, 0, -1):
        packs = [rows[i : i + k] for i in range(0, g, k)]
        cost = 0.0
        for p in packs:
            Lp = prompt_tokens + sum(int(kept[r]) + 1 for r in p)
            # one row is TRL's own forward, whose causal attention can skip the upper triangle
            cost += Lp * linear + Lp * Lp * pair / (2 if k == 1 else 1) + patches * vision
        if best is None or cost < best[0]:
            best = (cost, packs)
    return best[1]


def _packed_forward(model, packed, ids, am_np, pos, mm, P, Lp, attn, mask_dtype, autocast, pix, grid):
    """One forward of the packs (right-padded to ``Lp``) through TRL's fused LM head."""
    device = ids.device
    n = len(packed)
    tok = torch.empty(n, Lp, dtype=ids.dtype, device=device)
    shift_labels = torch.full((n, Lp), -100, dtype=torch.long, device=device)
    ppos = torch.zeros(*pos.shape[:-2], n, Lp, dtype=pos.dtype, device=device)
    pmm = torch.zeros(n, Lp, dtype=mm.dtype, device=device) if mm is not None else None
    allowed = torch.zeros(n, 1, Lp, Lp, dtype=torch.bool, device=device)  # built where it is used
    causal = torch.ones(Lp, Lp, dtype=torch.bool, device=device).tril()
    for i, (rows, cols, block, labels, _, _) in enumerate(packed):
        m = len(rows)
        r_t, c_t = torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)
        tok[i, :m] = ids[r_t, c_t]
        tok[i, m:] = ids[rows[0], P - 1]  # padding: a text token, scores nothing, attends to itself
        shift_labels[i, :m] = torch.from_numpy(labels).to(device)
        ppos[..., i, :m] = pos[..., r_t, c_t]
        if pmm is not None:
            pmm[i, :m] = mm[r_t, c_t]
        blk = torch.from_numpy(block).to(device)
        key_ok = torch.from_numpy(am_np[rows, cols]).to(device)
        same = (blk[None, :] == -1) | (blk[None, :] == blk[:, None])  # [q, k]: prompt part or own block
        allowed[i, 0, :m, :m] = same & causal[:m, :m] & key_ok[None, :]
        idx = torch.arange(m, Lp, device=device)
        allowed[i, 0, idx, idx] = True
    if attn == "eager":
        mask4 = torch.zeros(allowed.shape, dtype=mask_dtype, device=device)
        mask4 = mask4.masked_fill(~allowed, torch.finfo(mask_dtype).min)
    else:
        mask4 = allowed
    inputs = {"input_ids": tok, "attention_mask": mask4, "position_ids": ppos}
    if pmm is not None:
        inputs["mm_token_type_ids"] = pmm
    if any(p is not None and p.numel() for p in pix):
        inputs["pixel_values"] = torch.cat(pix)
        inputs["image_grid_thw"] = torch.cat(grid)
    with autocast():
        return model(**inputs, shift_labels=shift_labels, fused_lm_head=True)


def group_rows(
    prompt_ids, prompt_mask, pixel_rows: list[torch.Tensor | None], grids: list
) -> list[list[int]]:
    """Sets of row indices with identical prompt ids, prompt mask, image grids and pixels (first-seen order)."""
    sets: list[list[int]] = []
    by_key: dict[tuple, list[list[int]]] = {}
    for r in range(prompt_ids.shape[0]):
        key = (tuple(prompt_ids[r].tolist()), tuple(prompt_mask[r].tolist()), grids[r])
        for s in by_key.setdefault(key, []):
            a, b = pixel_rows[s[0]], pixel_rows[r]
            if (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)):
                s.append(r)
                break
        else:
            s = [r]
            by_key[key].append(s)
            sets.append(s)
    return sets


def per_token_logps_and_entropies(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    *,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    num_images: list[int] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    autocast: Callable = nullcontext,
    pack_rows: int | None = None,
    repeated: Callable | None = None,
    stats: dict | None = None,
    **unsupported,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What TRL's ``_get_per_token_logps_and_entropies`` returns (``[B, C]`` log-probs, entropies or None),
    each micro-batch's shared prompts forwarded once (module docstring).

    ``input_ids`` / ``attention_mask`` ``# [B, P + C]`` are TRL's ``prompt | completion`` rows,
    ``logits_to_keep = C``. ``model`` must carry TRL's fused LM head (``add_fused_lm_head``), as the
    trainer's models do. A set of rows is packed into one sequence, or into a few consecutive packs when
    that costs fewer FLOPs (:func:`split_set`; ``pack_rows`` fixes the rows per pack instead). With
    ``repeated`` (TRL's method: ``(model, input_ids, attention_mask, logits_to_keep, compute_entropy,
    **multimodal) -> (logps, entropies)``), rows left alone in a pack go through it instead, in one call.
    ``stats`` (optional) gets ``rows``, ``sets``, ``packs``, ``solo``, ``tokens`` (tokens forwarded) and
    ``padded_tokens`` added up over the micro-batches.
    """
    bad = sorted(k for k, v in unsupported.items() if v is not None)
    if bad:
        raise ValueError(f"share_prompt_loss: inputs {bad} are not supported (only Qwen-VL image prompts); "
                         "set share_prompt_loss=False.")  # fmt: skip
    if (pixel_values is None) != (image_grid_thw is None) or (
        pixel_values is not None and num_images is None
    ):
        raise ValueError(
            "share_prompt_loss: pixel_values, image_grid_thw and num_images come together (Qwen-VL)"
        )
    B, L = input_ids.shape
    C = int(logits_to_keep)
    P = L - C
    if P < 1:
        raise ValueError(f"share_prompt_loss: no prompt column (sequence length {L}, logits_to_keep {C})")
    batch_size = batch_size or B
    device = input_ids.device
    placeholders = _placeholder_ids(model)
    # per-row image slices, as TRL cuts them
    if pixel_values is not None:
        rows_per_image = image_grid_thw.prod(dim=-1)
        cum_img = [0, *torch.tensor(num_images).cumsum(0).tolist()]
        per_sample = torch.stack([s.sum() for s in torch.split(rows_per_image, num_images)])
        cum_rows = [0, *per_sample.cumsum(0).tolist()]
        pix = [pixel_values[cum_rows[r] : cum_rows[r + 1]] for r in range(B)]
        grid = [image_grid_thw[cum_img[r] : cum_img[r + 1]] for r in range(B)]
        grid_key = [tuple(map(tuple, g.tolist())) for g in grid]
    else:
        pix, grid, grid_key = [None] * B, [None] * B, [None] * B
    inner = unwrap_model(model)
    attn = inner.config.get_text_config()._attn_implementation
    costs = pack_costs(inner.config)
    mask_dtype = inner.get_input_embeddings().weight.dtype
    all_logps, all_ent = [], []
    for start in range(0, B, batch_size):
        end = min(start + batch_size, B)
        ids, am = input_ids[start:end], attention_mask[start:end]
        mm = mm_token_type_ids[start:end] if mm_token_type_ids is not None else None
        if pixel_values is not None:
            chunk_grid = torch.cat(grid[start:end]) if any(g.numel() for g in grid[start:end]) else None
        else:
            chunk_grid = None
        pos = _positions(model, ids, am, chunk_grid, mm)  # [B', L] or [3, B', L]
        sets = group_rows(ids[:, :P], am[:, :P], pix[start:end], grid_key[start:end])
        ids_np = ids.detach().cpu().numpy()
        am_np = am.detach().cpu().numpy().astype(bool)
        comp_np = am_np[:, P:]  # completion columns up to the last attended one are kept
        kept_of = np.where(comp_np.any(1), C - np.argmax(comp_np[:, ::-1], axis=1), 0)
        n_sets = len(sets)
        sets = [
            pack
            for s in sets
            for pack in split_set(
                s,
                int(am_np[s[0], : P - 1].sum()),
                kept_of,
                costs,
                pack_rows,
                patches=0 if pix[start + s[0]] is None else pix[start + s[0]].shape[0],
            )
        ]
        if any(int(ids_np[s[0], P - 1]) in placeholders for s in sets):
            raise ValueError("share_prompt_loss: a prompt ends with an image placeholder token; set "
                             "share_prompt_loss=False.")  # fmt: skip
        solo = [s[0] for s in sets if len(s) == 1] if repeated is not None else []
        sets = [s for s in sets if len(s) > 1 or repeated is None]
        packed = []  # per pack: rows, cols, block, labels (numpy), block starts, kept completion columns
        for s in sets:
            pc = np.flatnonzero(am_np[s[0], : P - 1])  # the prompt minus its last column, padding dropped
            rows, cols = [np.full(len(pc), s[0])], [pc]
            block, labels = [np.full(len(pc), -1)], [np.full(len(pc), -100)]
            starts, kept, n_tok = [], [], len(pc)
            for b, r in enumerate(s):
                k = int(kept_of[r])
                starts.append(n_tok)
                kept.append(k)
                n_tok += k + 1
                rows.append(np.full(k + 1, r))
                cols.append(np.arange(P - 1, P + k))
                block.append(np.full(k + 1, b))
                lab = np.where(am_np[r, P : P + k], ids_np[r, P : P + k], -100)
                labels.append(np.append(lab, -100))  # block position j predicts completion column j
            rows, cols, block, labels = (np.concatenate(x) for x in (rows, cols, block, labels))
            packed.append((rows, cols, block, labels, starts, kept))
        n = len(packed)
        Lp = max((len(p[0]) for p in packed), default=0)
        # each row's C outputs, gathered from [0 | packs' outputs | solo rows' outputs]: block position j
        # predicts completion column j; beyond the kept columns (trailing padding) TRL returns 0 as well
        index = torch.zeros(end - start, C, dtype=torch.long)
        flat_lp, flat_ent = [input_ids.new_zeros(1, dtype=torch.float32)], []
        if packed:
            reps = [start + s[0] for s in sets]
            out = _packed_forward(
                model, packed, ids, am_np, pos, mm, P, Lp, attn, mask_dtype, autocast,
                [pix[r] for r in reps], [grid[r] for r in reps],
            )  # fmt: skip
            flat_lp.append(out.log_probs.reshape(-1))
            flat_ent.append(out.entropy.reshape(-1) if compute_entropy else None)
            for i, (_, _, _, _, starts, kept) in enumerate(packed):
                for b, r in enumerate(sets[i]):
                    index[r, : kept[b]] = 1 + i * Lp + starts[b] + torch.arange(kept[b])
        if solo:  # rows TRL's own forward computes more cheaply (split_set), in one call
            sub = {}
            if mm is not None:
                sub["mm_token_type_ids"] = mm[solo]
            if pixel_values is not None:
                sub["pixel_values"] = torch.cat([pix[start + r] for r in solo])
                sub["image_grid_thw"] = torch.cat([grid[start + r] for r in solo])
                sub["num_images"] = [num_images[start + r] for r in solo]
            lp, ent = repeated(model, ids[solo], am[solo], C, compute_entropy, **sub)
            base = 1 + n * Lp
            for q, r in enumerate(solo):
                index[r] = base + q * C + torch.arange(C)
            flat_lp.append(lp.reshape(-1))
            flat_ent.append(ent.reshape(-1) if compute_entropy else None)
        index = index.to(device)
        all_logps.append(torch.cat([x.to(flat_lp[-1].dtype) for x in flat_lp])[index])
        if compute_entropy:
            all_ent.append(torch.cat([flat_lp[0].to(flat_lp[-1].dtype), *flat_ent])[index])
        if stats is not None:
            stats["rows"] = stats.get("rows", 0) + (end - start)
            stats["sets"] = stats.get("sets", 0) + n_sets
            stats["packs"] = stats.get("packs", 0) + n
            stats["solo"] = stats.get("solo", 0) + len(solo)
            stats["tokens"] = stats.get("tokens", 0) + sum(len(p[0]) for p in packed) + len(solo) * L
            stats["padded_tokens"] = stats.get("padded_tokens", 0) + n * Lp + len(solo) * L
    logps = torch.cat(all_logps)
    return logps, (torch.cat(all_ent) if compute_entropy else None)


def check_share_prompt_loss(trainer) -> None:
    """``share_prompt_loss``: refused (``ValueError``) where the packed forward is not exact for the trainer's
    model or reference model (:func:`check_supported`), or with tools. Reads ``trainer.args``, ``.tools``,
    ``.model``, ``.ref_model``, ``.aux_loss_enabled``."""
    if getattr(trainer.args, "share_prompt_loss", False):
        if getattr(trainer, "tools", None):
            raise ValueError(
                "share_prompt_loss=True: with tools a completion can carry its own images and tokens TRL "
                "masks per row; set share_prompt_loss=False."
            )
        check_supported(trainer.model, aux_loss=trainer.aux_loss_enabled)
        if trainer.ref_model is not None:
            check_supported(trainer.ref_model, what="reference model")


def shared_logps_and_entropies(
    trl: Callable, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
    *, autocast: Callable = nullcontext, **multimodal,
):  # fmt: skip
    """``NCGRPOTrainer``'s loss-side seam with ``args.share_prompt_loss``: what TRL's
    ``_get_per_token_logps_and_entropies`` (``trl``, the bound method; old-log-prob, reference and loss
    passes) returns, through :func:`per_token_logps_and_entropies`, with TRL's method for the rows left
    alone in a pack. ``(logps, entropies, None)``: no MoE aux loss (refused by :func:`check_supported`)."""

    def repeated(m, ids, am, c, ent, **mm):
        return trl(m, ids, am, c, None, ent, False, **mm)[:2]

    logps, entropies = per_token_logps_and_entropies(
        model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
        autocast=autocast, repeated=repeated, **multimodal,
    )  # fmt: skip
    return logps, entropies, None
