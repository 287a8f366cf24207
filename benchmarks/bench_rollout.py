"""Rollout cost of NC-GRPO vs vanilla GRPO at the same group size G = 2n.

Same model, same prompts, one process; the two rollouts are interleaved (alternating which goes
first) and the median wall time of each is reported, plus the hook's share of the prefill forward
(hook bodies timed against the whole prefill with device synchronisation, in separate runs so the
synchronisation does not touch the main ratio). Random weights: every row is forced to decode
exactly ``--max-new-tokens`` tokens (``min_new_tokens``), so both sides do the same decode work.

    python benchmarks/bench_rollout.py --size tiny --prompts 8 --n 4 --max-new-tokens 32 --repeats 5
    python benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --size 1.5b --images 1

Arms: TRL's vanilla (one prefill per row, no hook), NC-GRPO with ``share_prompt_prefill`` (one vision
pass and one prompt prefill per prompt) and NC-GRPO with one prefill per row. Targets (issue 24):
with image prompts and G = 8, shared / vanilla <= 0.6 (goal); one prefill per row / vanilla <= 1.02.

    python benchmarks/bench_rollout.py --size tiny --images 1 --image-size 224 --prompts 4 --n 4 \
        --max-new-tokens 16 --repeats 7 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Qwen2.5 text towers (random weights) with a small vision tower; vocab as in the real models.
SIZES = {
    "tiny": dict(),
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
SMALL_VISION = dict(vision_depth=4, vision_hidden_size=256, vision_intermediate_size=512, vision_num_heads=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch (P)")
    p.add_argument("--n", type=int, default=4, help="clean (= noisy) rollouts per prompt; G = 2n")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each method (interleaved)")
    p.add_argument("--images", type=int, default=0, help="images per prompt (0: text prompts)")
    p.add_argument("--image-size", type=int, default=112, help="image side in pixels (area cap)")
    p.add_argument("--sigma", type=float, default=0.2)
    p.add_argument("--site", default="final_norm", help="'final_norm' or a layer index")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--out", default="runs/bench_rollout.json", help="JSON output path")
    p.add_argument(
        "--time-cap",
        type=float,
        default=0.0,
        help="seconds from the process's start (imports and the model's build included; 0: no cap). The "
        "repeats stop when the next round would pass 60%% of it, the breakdown runs up to 80%%, the hook "
        "share up to 100%%; the summary prints whatever ran (at least one repeat of each arm)",
    )
    p.add_argument(
        "--save-model",
        default=None,
        metavar="DIR",
        help="save the built model and processor to DIR (save_pretrained) before timing, for a later part",
    )
    p.add_argument(
        "--build-only", action="store_true", help="build and save the model (--save-model), time nothing"
    )
    args = p.parse_args(argv)
    if args.build_only and not args.save_model:
        p.error("--build-only needs --save-model DIR")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.time_cap < 0:
        p.error("--time-cap must be >= 0")
    return args


def process_age() -> float:
    """Seconds since this process started (Linux: /proc; elsewhere 0), so that a time cap covers the
    interpreter's start, the imports and the model's build as a part's outer cap does."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        import os

        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


class Deadline:
    """A time cap: ``left(frac)`` is the time before ``frac`` of the cap (inf with no cap), counted from
    ``start`` (a ``clock`` reading; default: now); ``fits(frac, need)`` says whether ``need`` more seconds
    fit before it."""

    def __init__(self, cap_s: float, clock=time.perf_counter, start: float | None = None):
        self.cap, self.clock = cap_s, clock
        self.t0 = clock() if start is None else start
        self.cut: list[str] = []  # what the cap cut short, for the summary

    def left(self, frac: float = 1.0) -> float:
        if not self.cap:
            return float("inf")
        return self.t0 + frac * self.cap - self.clock()

    def fits(self, frac: float, need: float) -> bool:
        return self.left(frac) >= need


def hbm_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> float | None:
    """Measured device-memory bandwidth in bytes/s (a device-to-device copy, bytes read plus written);
    None off CUDA (a CPU figure would be the caches')."""
    if device.type != "cuda":
        return None
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best


def decode_roofline(model, rows: int, prompt_tokens: int, new_tokens: int, bandwidth: float | None) -> dict:
    """The fewest bytes one decode step must read (the language model's weights once, the KV cache of
    every row at the mean context) and that over ``bandwidth``: the step's HBM floor."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    skip = {id(p) for p in visual.parameters()} if visual is not None else set()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    t = model.config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    elt = next(model.parameters()).element_size()
    ctx = prompt_tokens + new_tokens / 2
    kv_bytes = 2 * t.num_hidden_layers * t.num_key_value_heads * head_dim * elt * rows * ctx
    out = {"weight_bytes": weight_bytes, "kv_bytes_mean": kv_bytes, "bandwidth_Bps": bandwidth}
    out["floor_s_per_step"] = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device) -> dict:
    import os

    import transformers

    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = info["cpu"]
    return info


def build(args, device, dtype):
    from ncgrpo.toy.model import DEFAULT_CORPUS, build_processor, build_tokenizer, tiny_qwen2_5_vl

    tok = build_tokenizer()
    proc = build_processor(tok, image_size=args.image_size)
    overrides = dict(SIZES[args.size])
    if args.size != "tiny":
        overrides.update(SMALL_VISION)
    attn = "sdpa"
    model = tiny_qwen2_5_vl(processor=proc, seed=args.seed, attn_implementation=attn, **overrides)
    model = model.to(device=device, dtype=dtype)
    rng = np.random.RandomState(args.seed)
    prompts, images = [], []
    for i in range(args.prompts):
        text = DEFAULT_CORPUS[i % len(DEFAULT_CORPUS)]
        if args.images:
            content = [{"type": "image"}] * args.images + [{"type": "text", "text": text}]
            from PIL import Image

            s = args.image_size
            images.append(
                [Image.fromarray((rng.rand(s, s, 3) * 255).astype("uint8")) for _ in range(args.images)]
            )
        else:
            content = text
        prompts.append([{"role": "user", "content": content}])
    return model, proc, prompts, (images if args.images else None)


def main(argv=None) -> dict:
    from ncgrpo.rollout import generate_groups
    from ncgrpo.toy.model import count_parameters

    # the time cap counts from the process's start when run as a script (from this call when called)
    t_start = time.perf_counter() - (process_age() if argv is None else 0.0)
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, proc, prompts, images = build(args, device, dtype)
    build_s = time.perf_counter() - t0
    print(f"built {args.size} in {build_s:.1f}s", file=sys.stderr, flush=True)
    if args.save_model:
        from ncgrpo.toy.model import save_tiny

        save_tiny(model, proc, args.save_model)
        print(f"saved the model to {args.save_model}", file=sys.stderr, flush=True)
        if args.build_only:
            return {"saved": args.save_model, "build_s": build_s}
    site = args.site if args.site == "final_norm" else int(args.site)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def rollout(nc: bool, step: int, share: bool = False, **kw):
        return generate_groups(
            model,
            proc,
            prompts,
            images,
            n=args.n,
            sigma=args.sigma,
            step=step,
            seed=args.seed,
            site=site,
            use_hook=nc,
            share_prompt_prefill=share,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            do_sample=True,
            **kw,
        )

    peak_mem: dict[str, int] = {}

    def timed(nc: bool, share: bool, step: int, name: str = "") -> tuple[float, float]:
        """(wall seconds, process CPU seconds); the latter is robust to other load on a shared CPU."""
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t, c = time.perf_counter(), time.process_time()
        rollout(nc, step, share)
        sync()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if device.type == "cuda":
            peak_mem[name] = max(peak_mem.get(name, 0), torch.cuda.max_memory_allocated(device))
        return wall, cpu

    # arms: TRL's vanilla (one prefill per row, no hook), NC-GRPO sharing the prompt's prefill (the
    # default), NC-GRPO with one prefill per row
    arms = {"vanilla": (False, False), "ncgrpo": (True, True), "ncgrpo_noshare": (True, False)}
    # warm-up (kernels, allocator, tokenizer caches)
    for nc, share in arms.values():
        r = rollout(nc, 0, share)
    prompt_len = r.prompt_length

    times = {k: [] for k in arms}
    cpu_times = {k: [] for k in arms}
    names = list(arms)
    cap = Deadline(args.time_cap, start=t_start)
    round_s = 0.0
    for i in range(args.repeats):
        if i and not cap.fits(0.6, round_s):
            cap.cut.append(f"repeats: {i} of {args.repeats} (the next round would pass 60% of the time cap)")
            break
        t_round = time.perf_counter()
        order = names[i % len(names) :] + names[: i % len(names)]  # rotated: each arm goes first in turn
        for name in order:
            wall, cpu = timed(*arms[name], step=i + 1, name=name)
            times[name].append(wall)
            print(f"repeat {i}: {name} {wall:.3f}s wall, {cpu:.3f}s CPU", file=sys.stderr, flush=True)
            cpu_times[name].append(cpu)
        round_s = time.perf_counter() - t_round
    repeats_done = len(times["vanilla"])

    # where a rollout's time goes (synchronised timing; separate runs): the vision tower, the prefill
    # forward (vision tower, prompt, lm_head), the rest is decoding. Repeated: the hook's prefill clock on
    # the one-prefill-per-row arm; shared: the shared prefix pass plus the branch forward.
    visual = getattr(getattr(model, "model", None), "visual", None)
    vis = {"t": 0.0, "t0": 0.0}
    handles = []
    if visual is not None:

        def vis_pre(m, a):
            sync()
            vis["t0"] = time.perf_counter()

        def vis_post(m, a, o):
            sync()
            vis["t"] += time.perf_counter() - vis["t0"]

        handles = [visual.register_forward_pre_hook(vis_pre), visual.register_forward_hook(vis_post)]
    breakdown = {}
    try:
        for name, share in (("ncgrpo_noshare", False), ("ncgrpo", True)):
            rows = []
            for i in range(max(3, args.repeats // 2)):
                if not cap.fits(0.8, (rows[-1][0] if rows else 0.0)):
                    cap.cut.append(f"breakdown {name}: {len(rows)} runs (80% of the time cap)")
                    break
                vis["t"] = 0.0
                sync()
                t = time.perf_counter()
                out = rollout(True, i + 1, share, timing=True)
                sync()
                wall = time.perf_counter() - t
                shared = out.extra.get("shared_prefill")
                if shared is not None and shared.shared:  # the prefix pass runs the vision tower inside it
                    prefill = shared.prefix_s + out.record.prefill_s
                else:  # generate encodes the images before its prefill forward
                    prefill = vis["t"] + out.record.prefill_s
                rows.append((wall, vis["t"], prefill))
            if not rows:
                continue
            w, v, pf = (statistics.median(x[j] for x in rows) for j in range(3))
            breakdown[name] = {
                "wall_s": w,
                "vision_s": v,
                "prefill_s": pf,
                "vision_share": statistics.median(x[1] / x[0] for x in rows),
                "prefill_share": statistics.median(x[2] / x[0] for x in rows),
            }
    finally:
        for h in handles:
            h.remove()

    # the hook's share of the prefill forward (synchronised timing; separate runs, one prefill per row)
    shares = {}
    for positions in ("auto", "all"):
        hs, ps, last = [], [], 0.0
        for i in range(max(3, args.repeats // 2)):
            if not cap.fits(1.0, last):
                cap.cut.append(f"hook share positions={positions}: {len(hs)} runs (the time cap)")
                break
            t = time.perf_counter()
            rec = rollout(True, i + 1, False, timing=True, positions=positions).record
            last = time.perf_counter() - t
            hs.append(rec.hook_s)
            ps.append(rec.prefill_s)
        if not hs:
            continue
        shares[positions] = {
            "hook_s": statistics.median(hs),
            "prefill_s": statistics.median(ps),
            "share": statistics.median(h / p for h, p in zip(hs, ps, strict=True)),
        }

    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}

    def paired(key_times, k):
        return statistics.median(a / b for a, b in zip(key_times[k], key_times["vanilla"], strict=True))

    rows_n = args.prompts * 2 * args.n
    bandwidth = hbm_bandwidth(device)
    roof = decode_roofline(model, rows_n, prompt_len, args.max_new_tokens, bandwidth)
    decode = {}
    for k in arms:  # decode time per step: the rollout less its prefill (the synchronised breakdown's)
        b = breakdown.get(k) or breakdown.get("ncgrpo_noshare") or {}
        prefill = b.get("prefill_s", 0.0)
        step_s = max(med[k] - prefill, 0.0) / args.max_new_tokens
        floor = roof["floor_s_per_step"]
        decode[k] = {
            "s_per_step": step_s,
            "prefill_s_used": prefill,
            "hbm_roofline_fraction": (floor / step_s) if (floor and step_s) else None,
        }

    result = {
        "machine": machine(device),
        "config": vars(args),
        "params": count_parameters(model),
        "build_s": build_s,
        "rows": args.prompts * 2 * args.n,
        "prompt_tokens": prompt_len,
        "times_s": times,
        "median_s": med,
        "ratio": med["ncgrpo"] / med["vanilla"],
        "ratio_noshare": med["ncgrpo_noshare"] / med["vanilla"],
        "cpu_times_s": cpu_times,
        "cpu_median_s": cpu_med,
        "cpu_ratio": cpu_med["ncgrpo"] / cpu_med["vanilla"],
        "cpu_ratio_noshare": cpu_med["ncgrpo_noshare"] / cpu_med["vanilla"],
        "paired_ratio": {k: paired(times, k) for k in arms},
        "paired_cpu_ratio": {k: paired(cpu_times, k) for k in arms},
        "breakdown": breakdown,
        "hook_share_of_prefill": shares,
        "repeats_done": repeats_done,
        "time_cap_s": args.time_cap or None,
        "cut_by_time_cap": cap.cut,
        "new_tokens_per_s": {k: rows_n * args.max_new_tokens / med[k] for k in arms},
        "peak_memory_bytes": peak_mem or None,
        "decode": decode,
        "decode_roofline": roof,
    }

    print(f"# bench_rollout  {result['machine']['device_name']}  torch {torch.__version__}  {args.dtype}")
    print(
        f"# size={args.size} params={result['params']['total'] / 1e6:.1f}M  P={args.prompts} G={2 * args.n} "
        f"rows={result['rows']} prompt_tokens={prompt_len} new_tokens={args.max_new_tokens} "
        f"images/prompt={args.images} repeats={repeats_done} of {args.repeats} sigma={args.sigma} site={site}"
    )
    for c in cap.cut:
        print(f"# cut by --time-cap {args.time_cap:g}s: {c}")
    print(
        f"{'method':<34}{'median s':>10}{'min s':>10}{'max s':>10}{'x vanilla':>10}{'paired':>8}{'CPU s':>10}{'x vanilla':>10}{'paired':>8}"
    )
    labels = {
        "vanilla": "vanilla GRPO (TRL: no hook)",
        "ncgrpo": "NC-GRPO, shared prefill",
        "ncgrpo_noshare": "NC-GRPO, one prefill per row",
    }
    for k in arms:
        print(
            f"{labels[k]:<34}{med[k]:>10.3f}{min(times[k]):>10.3f}{max(times[k]):>10.3f}{med[k] / med['vanilla']:>10.4f}"
            f"{result['paired_ratio'][k]:>8.3f}{cpu_med[k]:>10.3f}{cpu_med[k] / cpu_med['vanilla']:>10.4f}"
            f"{result['paired_cpu_ratio'][k]:>8.3f}"
        )
    for k, b in breakdown.items():
        print(
            f"{labels[k]}: vision tower {100 * b['vision_share']:.1f}% and prefill (vision + prompt) "
            f"{100 * b['prefill_share']:.1f}% of the rollout ({1e3 * b['vision_s']:.1f} / {1e3 * b['prefill_s']:.1f} / "
            f"{1e3 * b['wall_s']:.1f} ms, synchronised runs)"
        )
    for pos, s in shares.items():
        print(
            f"hook share of prefill (positions={pos}): {100 * s['share']:.2f}%  "
            f"(hook {1e3 * s['hook_s']:.2f} ms / prefill {1e3 * s['prefill_s']:.1f} ms)"
        )
    for k in arms:
        d, mem = decode[k], (peak_mem or {}).get(k)
        frac = d["hbm_roofline_fraction"]
        print(
            f"{labels[k]}: {result['new_tokens_per_s'][k]:.0f} new tokens/s, decode {1e3 * d['s_per_step']:.2f} ms/step"
            + (f" = {100 * frac:.1f}% of the HBM roofline" if frac is not None else "")
            + (f", peak memory {mem / 2**30:.2f} GiB" if mem else "")
        )
    if roof["floor_s_per_step"]:
        print(
            f"# HBM roofline of a decode step: {roof['weight_bytes'] / 1e9:.2f} GB weights + "
            f"{roof['kv_bytes_mean'] / 1e9:.2f} GB KV at the mean context over {roof['bandwidth_Bps'] / 1e12:.2f} TB/s "
            f"(measured copy) = {1e3 * roof['floor_s_per_step']:.3f} ms"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
