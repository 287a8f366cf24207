"""How much of a GRPO step is the repeated prompt, and what sharing it in the loss pass saves.

Issue 24, item 4. TRL's loss side (the old-log-prob forward, the loss forward and its backward, and a
reference forward when ``beta > 0``) processes every row's prompt: ``G x (P + C)`` tokens per group,
where a prompt shared by the group needs ``P + G x C``. Two measurements:

1. A FLOP count at the recipes' proportions (``recipes/base/geo3k_qwen2_5_vl_*``: G = 12, prompt
   P ~ 800 tokens with the image, completions C ~ 500) for Qwen2.5-VL-3B / 7B (their published
   configs): per group, the language model's matmul FLOPs ``2 N`` per token plus attention
   ``4 L d ctx`` per token (ctx: the tokens it attends to), and the vision tower (frozen: forward
   only) on the image's patches (4 per image token after the 2x2 merge).
2. The implemented path timed: ``ncgrpo.trainer.shared_loss.per_token_logps_and_entropies`` (what
   ``share_prompt_loss=True`` runs) against TRL 1.16's own ``GRPOTrainer._get_per_token_logps_and_entropies``
   (the repeated path), both on a model carrying TRL's fused LM head (temperature 0.9, log-probs and
   entropies), forward + backward of a GRPO-shaped loss (advantage-weighted log-probs plus an entropy
   term) over one micro-batch of ``G`` rows of one prompt. Models: a text Qwen2 (bench_train's
   ``small`` tower, hidden 256 x 4 layers) and a Qwen2.5-VL of the same text tower with a 4-layer
   vision tower and an image prompt. Three arms: TRL's method; ``shared`` (the packs
   ``shared_loss.split_set`` chooses, rows it leaves alone through TRL's method, as the trainer runs
   it); ``shared_one_pack`` (all G rows in one packed sequence, to show what the cost model avoids).
   Interleaved repeats (the order rotates), CPU time of this process; before timing, the log-probs,
   entropies, loss and every parameter's gradient of the shared path are compared with the repeated
   one (the exactness the tests check). The FLOP table also gives what ``shared_loss`` runs: the packs
   ``split_set`` chooses for the published sizes, attention over each pack's full masked square.

    python benchmarks/bench_loss_share.py --threads 1 --repeats 7
    python benchmarks/bench_loss_share.py --threads 1 --repeats 5 --kinds text --proxy-C 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ncgrpo.trainer.shared_loss import pack_costs, split_set  # noqa: E402

# Published configs (config.json of Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct): text tower and vision tower
ARCH = {
    "qwen2.5-vl-3b": dict(
        hidden=2048, layers=36, inter=11008, heads=16, kv_heads=2, vocab=151936,
        v_hidden=1280, v_layers=32, v_inter=3420,
    ),
    "qwen2.5-vl-7b": dict(
        hidden=3584, layers=28, inter=18944, heads=28, kv_heads=4, vocab=152064,
        v_hidden=1280, v_layers=32, v_inter=3420,
    ),
}  # fmt: skip


def text_flops_per_token(a: dict, ctx: float, logits: bool) -> float:
    """Forward FLOPs of one token through the text tower attending to ``ctx`` tokens."""
    d, L = a["hidden"], a["layers"]
    kv = d // a["heads"] * a["kv_heads"]
    per_layer = 2 * (d * d + 2 * d * kv + d * d) + 2 * 3 * d * a["inter"] + 4 * d * ctx
    return L * per_layer + (2 * d * a["vocab"] if logits else 0)


def vision_flops(a: dict, patches: int) -> float:
    """Forward FLOPs of the vision tower on ``patches`` patches (window attention ignored: an upper bound
    on attention, small next to the MLPs at these sizes)."""
    d, L = a["v_hidden"], a["v_layers"]
    return patches * L * (2 * 4 * d * d + 2 * 3 * d * a["v_inter"] + 4 * d * min(patches, 64 * 4))


def _config(a: dict):
    """A config-like object with ARCH's sizes, for shared_loss.pack_costs."""
    from types import SimpleNamespace

    text = SimpleNamespace(
        hidden_size=a["hidden"], num_attention_heads=a["heads"], num_key_value_heads=a["kv_heads"],
        intermediate_size=a["inter"], vocab_size=a["vocab"], num_hidden_layers=a["layers"], head_dim=None,
    )  # fmt: skip
    vision = SimpleNamespace(hidden_size=a["v_hidden"], intermediate_size=a["v_inter"], depth=a["v_layers"])
    return SimpleNamespace(get_text_config=lambda: text, vision_config=vision)


def flop_table(P: int, C: int, G: int, image_tokens: int) -> dict:
    """Per group: tokens and forward FLOPs of the loss side, repeated vs shared prompt."""
    out = {}
    for name, a in ARCH.items():
        # prompt token t attends to t+1 tokens (mean (P+1)/2); completion token j to P + j + 1
        prompt = P * text_flops_per_token(a, (P + 1) / 2, logits=False)
        # logits only where the loss reads them: the completion positions (TRL's logits_to_keep)
        completion = C * text_flops_per_token(a, P + (C + 1) / 2, logits=True)
        vis = vision_flops(a, 4 * image_tokens)
        repeated = G * (prompt + completion + vis)
        shared = prompt + vis + G * completion
        # what shared_loss runs: the packs split_set chooses for this model, each a sequence of Lp tokens
        # with attention over the full masked square (sdpa/eager compute the masked entries), the last
        # prompt token once per row, the vision tower once per pack
        packs = split_set(list(range(G)), P - 1, [C] * G, pack_costs(_config(a)), patches=4 * image_tokens)
        packed = 0.0
        for pack in packs:
            Lp = P - 1 + len(pack) * (C + 1)
            packed += vis + (P - 1) * text_flops_per_token(a, Lp, logits=False)
            packed += len(pack) * (C + 1) * text_flops_per_token(a, Lp, logits=True)
        out[name] = {
            "tokens_repeated": G * (P + C),
            "tokens_shared": P + G * C,
            "flops_repeated": repeated,
            "flops_shared": shared,
            "ratio": shared / repeated,
            "packs": [len(p) for p in packs],
            "flops_packed": packed,
            "ratio_packed": packed / repeated,
            "repeated_prompt_share": 1 - shared / repeated,
            "vision_share_of_repeated": G * vis / repeated,
        }
    return out


# --------------------------------------------------------------------------------------------------
# the implemented path, timed
# --------------------------------------------------------------------------------------------------
TEMPERATURE = 0.9
VL_IMAGE = 224  # pixels: 16 x 16 patches of 14, 64 image tokens after the 2 x 2 merge


#: timed text towers: the proxy (hidden 256 x 4 layers) and bench_rollout's Qwen2.5 sizes (random weights)
TOWERS = {
    "proxy": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def _towers() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import SIZES

    return {**TOWERS, "0.5b": SIZES["0.5b"], "1.5b": SIZES["1.5b"]}


def build(kind: str, seed: int, tower_name: str = "proxy"):
    """A model with TRL's fused LM head, its tokenizer or processor."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from trl.trainer.utils import add_fused_lm_head

    from tiny_models import build_processor, build_tokenizer, tiny_qwen2_5_vl, tiny_text_model

    tower = dict(_towers()[tower_name])
    tok = build_tokenizer()
    if kind == "text":
        model, proc = tiny_text_model("qwen2", tokenizer=tok, seed=seed, **tower), tok
    else:
        proc = build_processor(tok, image_size=VL_IMAGE)
        model = tiny_qwen2_5_vl(
            processor=proc,
            seed=seed,
            vision_depth=4,
            vision_hidden_size=256,
            vision_intermediate_size=512,
            **tower,
        )
        model.model.visual.requires_grad_(False)  # frozen, as the paper's section 4.1
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    return model.train(), proc


def loss_inputs(kind: str, proc, vocab: int, G: int, P: int, C: int, seed: int) -> dict:
    """One prompt's ``G`` rows as TRL builds them: ``prompt | completion``, completions of ``C`` tokens."""
    import numpy as np
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    if kind == "text":
        prompt = torch.randint(5, vocab, (1, P), generator=g)
        enc = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    else:
        img = Image.fromarray(
            np.random.default_rng(seed).integers(0, 255, (VL_IMAGE, VL_IMAGE, 3), dtype=np.uint8)
        )

        def encode(words: int) -> dict:
            msg = proc.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "word " * words}]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            return dict(proc(text=[msg], images=[img], return_tensors="pt"))

        lo, hi = 1, P  # the longest text whose prompt (image tokens included) fits in P tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if encode(mid)["input_ids"].shape[1] <= P else (lo, mid - 1)
        enc = encode(lo)
    comp = torch.randint(5, vocab, (G, C), generator=g)
    rows = torch.zeros(G, dtype=torch.long)
    out = {
        "input_ids": torch.cat([enc["input_ids"][rows], comp], 1),
        "attention_mask": torch.cat([enc["attention_mask"][rows], torch.ones_like(comp)], 1),
        "mm": {},
        "adv": torch.randn(G, generator=g),
        "C": C,
    }
    if kind != "text":
        out["mm"] = {
            "pixel_values": enc["pixel_values"].repeat(G, 1),
            "image_grid_thw": enc["image_grid_thw"][rows],
            "num_images": [1] * G,
            "mm_token_type_ids": torch.cat([enc["mm_token_type_ids"][rows], torch.zeros_like(comp)], 1),
        }
    return out


def repeated_path(model, x):
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    ns = SimpleNamespace(accelerator=SimpleNamespace(autocast=lambda: torch.autocast("cpu", enabled=False)))
    fn = GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__
    logps, ent, _ = fn(
        ns, model, x["input_ids"], x["attention_mask"], x["C"], compute_entropy=True, **x["mm"]
    )
    return logps, ent


def trl_rows(model, ids, am, c, compute_entropy, **mm):
    """TRL's method on a subset of rows: shared_loss's fallback for rows it leaves alone, as the trainer."""
    return repeated_path(model, {"input_ids": ids, "attention_mask": am, "C": c, "mm": mm})


def shared_path(model, x, pack_rows=None, stats=None):
    from ncgrpo.trainer.shared_loss import per_token_logps_and_entropies

    return per_token_logps_and_entropies(
        model, x["input_ids"], x["attention_mask"], x["C"], compute_entropy=True, pack_rows=pack_rows,
        repeated=trl_rows, stats=stats, **x["mm"],
    )  # fmt: skip


def step(model, x, path):
    """Forward + backward of a GRPO-shaped loss; returns the loss, log-probs and gradients."""
    model.zero_grad(set_to_none=True)
    logps, ent = path(model, x)
    loss = -(x["adv"][:, None] * logps + 0.01 * ent).mean()
    loss.backward()
    return loss.detach(), logps.detach(), ent.detach()


def to_device(x: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The loss inputs on ``device``; floating tensors (pixels, advantages) in ``dtype``."""

    def mv(v):
        if not torch.is_tensor(v):
            return v
        return v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)

    return {k: ({n: mv(t) for n, t in v.items()} if k == "mm" else mv(v)) for k, v in x.items()}


def measure(kind: str, args) -> dict:
    torch.manual_seed(args.seed)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model, proc = build(kind, args.seed, args.tower)
    model = model.to(device=device, dtype=dtype)
    x = loss_inputs(kind, proc, model.config.get_text_config().vocab_size, args.G, args.proxy_P, args.proxy_C,
                    args.seed)  # fmt: skip
    x = to_device(x, device, dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # CUDA: synchronised wall time; CPU: this process's CPU time (robust to a shared machine's load)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    P = x["input_ids"].shape[1] - args.proxy_C
    la, pa, ea = step(model, x, repeated_path)
    ga = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    lb, pb, eb = step(model, x, shared_path)
    gb = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rel = max(float((ga[n] - gb[n]).float().norm() / ga[n].float().norm().clamp_min(1e-30)) for n in ga)
    exact = {
        "loss_abs_diff": abs(float(la - lb)),
        "max_abs_logp_diff": float((pa - pb).abs().max()),
        "max_abs_entropy_diff": float((ea - eb).abs().max()),
        "bit_identical_logps": bool(torch.equal(pa, pb)),
        "max_rel_grad_diff": rel,
        "same_params": sorted(ga) == sorted(gb),
    }
    stats = {}
    shared_path(model, x, stats=stats)  # how the cost model packed the group
    arms = {
        "repeated": repeated_path,
        "shared": shared_path,  # what share_prompt_loss runs: packs chosen by shared_loss.split_set
        "shared_one_pack": partial(shared_path, pack_rows=args.G),  # all G rows in one packed sequence
    }
    times = {k: [] for k in arms}
    names = list(arms)
    peak = {}
    t_start, round_s, cut = args.t_start, 0.0, None
    for r in range(args.repeats):
        if r and args.time_cap and time.perf_counter() - t_start + round_s > args.time_cap:
            cut = f"repeats: {r} of {args.repeats} (--time-cap {args.time_cap:g}s)"
            break
        t_round = time.perf_counter()
        for k in names[r % len(names) :] + names[: r % len(names)]:  # the order rotates
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = clock()
            step(model, x, arms[k])
            sync()
            times[k].append(clock() - t)
            if device.type == "cuda":
                peak[k] = max(peak.get(k, 0), torch.cuda.max_memory_allocated(device))
        round_s = time.perf_counter() - t_round
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "device": str(device),
        "dtype": args.dtype,
        "tower": args.tower,
        "clock": "wall (synchronised)" if device.type == "cuda" else "process CPU",
        "attn_implementation": model.config.get_text_config()._attn_implementation,
        "repeats_done": len(times["repeated"]),
        "cut_by_time_cap": cut,
        "peak_memory_bytes": peak or None,
        "kind": kind,
        "P": P,
        "C": args.proxy_C,
        "G": args.G,
        "tokens_repeated": args.G * (P + args.proxy_C),
        "tokens_shared": P - 1 + args.G * (args.proxy_C + 1),
        "exactness": exact,
        "times_s": times,  # the clock above
        "median_s": med,
        **({"cpu_s": times, "median_cpu_s": med} if device.type == "cpu" else {}),
        "packs": stats["packs"],
        "ratio": med["shared"] / med["repeated"],
        "ratio_one_pack": med["shared_one_pack"] / med["repeated"],
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, default=800, help="prompt tokens incl. the image's (FLOP count)")
    p.add_argument("--C", type=int, default=500, help="completion tokens (FLOP count)")
    p.add_argument("--G", type=int, default=12)
    p.add_argument(
        "--image-tokens", type=int, default=600, help="image tokens in the prompt (after the merge)"
    )
    p.add_argument(
        "--proxy-P", type=int, default=160, help="prompt tokens of the timed models (incl. 64 image)"
    )
    p.add_argument("--proxy-C", type=int, default=100, help="completion tokens of the timed models")
    p.add_argument("--kinds", default="text,vl", help="timed models: text (Qwen2) and/or vl (Qwen2.5-VL)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_loss_share.json")
    p.add_argument("--device", default="cpu", help="cpu or cuda (CUDA: synchronised wall time)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--tower", default="proxy", choices=["proxy", "0.5b", "1.5b"], help="the timed model's text tower"
    )
    p.add_argument(
        "--time-cap", type=float, default=0.0, help="seconds from the process's start (imports, builds and "
        "the exactness check included; 0: no cap); each timed model runs at least one repeat, the summary "
        "prints the repeats that ran",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.repeats < 1 or args.time_cap < 0:
        p.error("--repeats must be >= 1 and --time-cap >= 0")
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in ("text", "vl") for k in kinds):
        p.error(f"--kinds: text and/or vl, got {args.kinds!r}")
    return args


def main(argv=None):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import process_age

    # the time cap counts from the process's start when run as a script (from this call when called)
    t_start = time.perf_counter() - (process_age() if argv is None else 0.0)
    args = parse_args(argv)
    args.t_start = t_start
    torch.set_num_threads(args.threads)
    flops = flop_table(args.P, args.C, args.G, args.image_tokens)
    proxy = {k: measure(k, args) for k in args.kinds.split(",") if k}
    print(f"# loss side per group, G={args.G}, P={args.P} (image {args.image_tokens}), C={args.C}")
    for name, f in flops.items():
        print(
            f"{name}: tokens {f['tokens_repeated']} -> {f['tokens_shared']} ({f['tokens_shared'] / f['tokens_repeated']:.3f}x); "
            f"forward FLOPs {f['flops_repeated']:.3e} -> {f['flops_shared']:.3e} ({f['ratio']:.3f}x): the repeated prompt "
            f"is {100 * f['repeated_prompt_share']:.1f}% of the loss side (vision tower {100 * f['vision_share_of_repeated']:.1f}%); "
            f"as shared_loss packs it ({f['packs']}, dense masked attention) {f['flops_packed']:.3e} "
            f"({f['ratio_packed']:.3f}x)"
        )
    for k, m in proxy.items():
        e = m["exactness"]
        print(
            f"# {k} ({m['tower']} tower, {m['device']} {m['dtype']} {m['attn_implementation']}, G={m['G']}, P={m['P']}, "
            f"C={m['C']}; tokens {m['tokens_repeated']} -> {m['tokens_shared']}), forward+backward, "
            f"{m['repeats_done']} interleaved repeats ({m['clock']} s): repeated "
            f"{m['median_s']['repeated']:.3f} s, shared {m['median_s']['shared']:.3f} s ({m['packs']} pack(s)) = "
            f"{m['ratio']:.3f}x, all in one pack {m['median_s']['shared_one_pack']:.3f} s = {m['ratio_one_pack']:.3f}x; "
            f"loss diff {e['loss_abs_diff']:.1e}, log-prob {e['max_abs_logp_diff']:.1e}, entropy "
            f"{e['max_abs_entropy_diff']:.1e}, max relative gradient diff {e['max_rel_grad_diff']:.1e}"
            + (f"; cut by the time cap: {m['cut_by_time_cap']}" if m["cut_by_time_cap"] else "")
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "flops": flops, "proxy": proxy}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
