"""How much of a GRPO step is the repeated prompt, and what sharing it in the loss pass would save.

Issue 24, item 4. TRL's loss side (the old-log-prob forward, the loss forward and its backward, and a
reference forward when ``beta > 0``) processes every row's prompt: ``G x (P + C)`` tokens per group,
where a prompt shared by the group needs ``P + G x C``. Two measurements:

1. A FLOP count at the recipes' proportions (``recipes/base/geo3k_qwen2_5_vl_*``: G = 12, prompt
   P ~ 800 tokens with the image, completions C ~ 500) for Qwen2.5-VL-3B / 7B (their published
   configs): per group, the language model's matmul FLOPs ``2 N`` per token plus attention
   ``4 L d ctx`` per token (ctx: the tokens it attends to), and the vision tower (frozen: forward
   only) on the image's patches (4 per image token after the 2x2 merge).
2. A measured CPU proxy: a text Qwen2 model (bench_train's ``small`` tower) trained on one group,
   forward + backward of a policy-gradient loss over the completion tokens, (a) repeated: ``G`` rows of
   ``prompt + completion``, as TRL does; (b) shared: the prompt minus its last token forwarded once
   WITH gradient, its KV cache repeated to ``G`` rows (``batch_repeat_interleave``: differentiable),
   then ``G`` rows of ``last prompt token + completion`` on that cache. Interleaved repeats; the loss
   and every parameter's gradient of (b) are compared with (a) (the exactness check such a change
   would need).

    python benchmarks/bench_loss_share.py --threads 1 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

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
        out[name] = {
            "tokens_repeated": G * (P + C),
            "tokens_shared": P + G * C,
            "flops_repeated": repeated,
            "flops_shared": shared,
            "ratio": shared / repeated,
            "repeated_prompt_share": 1 - shared / repeated,
            "vision_share_of_repeated": G * vis / repeated,
        }
    return out


# --------------------------------------------------------------------------------------------------
# measured CPU proxy
# --------------------------------------------------------------------------------------------------
def build(seed: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import build_tokenizer, tiny_text_model

    return tiny_text_model(
        "qwen2",
        tokenizer=build_tokenizer(),
        seed=seed,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).train()


def pg_loss(logits: torch.Tensor, targets: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``-mean(A_i * log pi(o_it))`` over the completion tokens (the policy-gradient core of GRPO's loss)."""
    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]  # [G, C]
    return -(adv[:, None] * logp).mean()


def repeated_step(model, prompt, comp, adv):
    G = comp.shape[0]
    ids = torch.cat([prompt.expand(G, -1), comp], 1)
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=comp.shape[1] + 1).logits[:, :-1]
    loss = pg_loss(logits, comp, adv)
    loss.backward()
    return loss.detach()


def shared_step(model, prompt, comp, adv):
    from transformers import DynamicCache

    G, P = comp.shape[0], prompt.shape[1]
    cache = DynamicCache(config=model.config)
    model.model(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)  # once, with grad
    cache.batch_repeat_interleave(G)  # differentiable: the G rows' gradients sum into the one prefix
    ids = torch.cat([prompt[:, -1:].expand(G, -1), comp[:, :-1]], 1)  # [G, C]
    pos = torch.arange(P - 1, P - 1 + ids.shape[1])[None].expand(G, -1)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=pos).logits
    loss = pg_loss(logits, comp, adv)
    loss.backward()
    return loss.detach()


def measure(args) -> dict:
    torch.manual_seed(args.seed)
    model = build(args.seed)
    V = model.config.vocab_size
    prompt = torch.randint(5, V, (1, args.proxy_P))
    comp = torch.randint(5, V, (args.G, args.proxy_C))
    adv = torch.randn(args.G)
    # exactness: loss and gradients of the shared step against the repeated one
    model.zero_grad()
    la = repeated_step(model, prompt, comp, adv)
    ga = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    lb = shared_step(model, prompt, comp, adv)
    gb = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    rel = max(float((ga[n] - gb[n]).norm() / ga[n].norm().clamp_min(1e-30)) for n in ga)
    exact = {"loss_repeated": float(la), "loss_shared": float(lb), "loss_abs_diff": abs(float(la - lb)),
             "max_rel_grad_diff": rel, "same_params": sorted(ga) == sorted(gb)}  # fmt: skip
    times = {"repeated": [], "shared": []}
    for r in range(args.repeats):
        order = ["repeated", "shared"] if r % 2 == 0 else ["shared", "repeated"]
        for k in order:
            model.zero_grad()
            t = time.process_time()
            (repeated_step if k == "repeated" else shared_step)(model, prompt, comp, adv)
            times[k].append(time.process_time() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"exactness": exact, "cpu_s": times, "median_cpu_s": med, "ratio": med["shared"] / med["repeated"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--P", type=int, default=800, help="prompt tokens incl. the image's (FLOP count)")
    p.add_argument("--C", type=int, default=500, help="completion tokens (FLOP count)")
    p.add_argument("--G", type=int, default=12)
    p.add_argument(
        "--image-tokens", type=int, default=600, help="image tokens in the prompt (after the merge)"
    )
    p.add_argument("--proxy-P", type=int, default=160, help="prompt tokens of the CPU proxy")
    p.add_argument("--proxy-C", type=int, default=100, help="completion tokens of the CPU proxy")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_loss_share.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    flops = flop_table(args.P, args.C, args.G, args.image_tokens)
    proxy = measure(args)
    print(f"# loss side per group, G={args.G}, P={args.P} (image {args.image_tokens}), C={args.C}")
    for name, f in flops.items():
        print(
            f"{name}: tokens {f['tokens_repeated']} -> {f['tokens_shared']} ({f['tokens_shared'] / f['tokens_repeated']:.3f}x); "
            f"forward FLOPs {f['flops_repeated']:.3e} -> {f['flops_shared']:.3e} ({f['ratio']:.3f}x): the repeated prompt "
            f"is {100 * f['repeated_prompt_share']:.1f}% of the loss side (vision tower {100 * f['vision_share_of_repeated']:.1f}%)"
        )
    e = proxy["exactness"]
    print(
        f"# CPU proxy (text Qwen2 256x4, G={args.G}, P={args.proxy_P}, C={args.proxy_C}, forward+backward, "
        f"{args.repeats} interleaved repeats): repeated {proxy['median_cpu_s']['repeated']:.3f} s, shared "
        f"{proxy['median_cpu_s']['shared']:.3f} s = {proxy['ratio']:.3f}x; loss diff {e['loss_abs_diff']:.2e}, "
        f"max relative gradient diff {e['max_rel_grad_diff']:.2e}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "flops": flops, "proxy": proxy}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
