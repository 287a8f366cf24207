"""Rollout cost with the vLLM engine: NC-GRPO vs vanilla GRPO at the same G = 2n, and vLLM vs the
transformers engine on the same model. Run in .venv-vllm (scripts/setup_vllm.sh).

One ``LLM`` (the ncgrpo plugin active, checked at start-up); each rollout is one ``LLM.generate``
over P x G requests (n = 1 each, prompt duplicated G times, as TRL's colocate mode sends them).
Vanilla: every request clean, one shared SamplingParams. NC-GRPO: the second half of each group
carries its noise spec in ``extra_args`` (:func:`ncgrpo.engines.vllm.sampling_params_for_rows`).
A third arm sends the NC-GRPO requests with sigma 0 (same per-request SamplingParams and
extra_args, no perturbation) to separate vLLM's per-request cost from the plugin's. The arms are
interleaved (rotating which goes first) and medians are reported, with the time the worker spent
in the plugin's own code (read through the start-up check's RPC). Random weights: ``ignore_eos`` makes every
row decode exactly ``--max-new-tokens`` tokens, so both sides do the same decode work. The
transformers engine (:func:`ncgrpo.engines.rollout.generate_groups`, hook on) runs the same rows with
``min_new_tokens`` for the engine comparison.

    python benchmarks/bench_vllm_rollout.py --size tiny --prompts 8 --n 4 --max-new-tokens 32 --repeats 7

Target: median NC-GRPO / vanilla <= 1.02.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# text-only Qwen2 (vLLM's CPU build cannot run the VL models: they import torchvision); head_dim 64
# because the CPU attention kernels do not take smaller heads
SIZES = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch (P)")
    p.add_argument("--n", type=int, default=4, help="clean (= noisy) rollouts per prompt; G = 2n")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each vLLM method (interleaved)")
    p.add_argument("--hf-repeats", type=int, default=3, help="timed repeats of the transformers engine")
    p.add_argument("--sigma", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_vllm_rollout.json", help="JSON output path")
    return p.parse_args(argv)


def _cpu_name() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import _cpu_name as cpu_name  # a sibling script, not a package

    return cpu_name()


def main(argv=None) -> dict:
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    from ncgrpo.core.plan import plan_group, prompt_noise_id
    from ncgrpo.engines.rollout import generate_groups
    from ncgrpo.engines.vllm import check_plugin_active, sampling_params_for_rows
    from ncgrpo.toy.model import DEFAULT_CORPUS, build_tokenizer, count_parameters, save_tiny

    # the tiny text-model builder lives with the tests (tests/tiny_models.py); the library ships VL toys only
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import tiny_text_model

    def plan_batch(pids, n, sigma, seed, step):  # rows in request order: [p0 clean x n, p0 noisy x n, ...]
        return [row for pid in pids for row in plan_group(n, sigma, seed, step, pid)]

    args = parse_args(argv)
    tok = build_tokenizer()
    model = tiny_text_model("qwen2", tokenizer=tok, seed=args.seed, **SIZES[args.size]).eval()
    texts = [DEFAULT_CORPUS[i % len(DEFAULT_CORPUS)] for i in range(args.prompts)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    G = 2 * args.n
    tmp = tempfile.mkdtemp(prefix="bench_vllm_")
    save_tiny(model, tok, tmp)

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(
        model=tmp,
        dtype="float32",
        seed=args.seed,
        max_model_len=512,
        enforce_eager=device == "cpu",
        **({"kv_cache_memory_bytes": 1 << 28} if device == "cpu" else {"gpu_memory_utilization": 0.3}),
    )
    status = check_plugin_active(llm)
    start_s = time.perf_counter() - t0
    print(f"engine up in {start_s:.1f}s: {status}", file=sys.stderr, flush=True)

    base = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in ids for _ in range(G)]
    pids = [prompt_noise_id(p) for p in ids]

    def params(arm: str, step: int):
        if arm == "vanilla":
            return [base] * len(requests)
        rows = plan_batch(pids, args.n, args.sigma if arm == "ncgrpo" else 0.0, args.seed, step)
        return sampling_params_for_rows(base, rows)

    def timed_vllm(arm: str, step: int) -> tuple[float, float]:
        sp = params(arm, step)
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(requests, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.max_new_tokens for o in outs)
        return wall, time.process_time() - c

    arms = ["vanilla", "ncgrpo", "sigma0"]
    for arm in arms:
        timed_vllm(arm, 0)  # warm-up
    times = {a: [] for a in arms}
    in_engine = {a: [] for a in arms}  # seconds spent in the plugin's code inside the worker
    for i in range(args.repeats):
        order = arms[i % 3 :] + arms[: i % 3]  # rotate which arm goes first
        for name in order:
            before = check_plugin_active(llm)[0]["plugin_seconds"]
            wall, _ = timed_vllm(name, i + 1)
            in_engine[name].append(check_plugin_active(llm)[0]["plugin_seconds"] - before)
            times[name].append(wall)
            print(f"repeat {i}: vLLM {name} {wall:.3f}s", file=sys.stderr, flush=True)

    def timed_hf(step: int) -> float:
        t = time.perf_counter()
        generate_groups(
            model,
            tok,
            texts,
            n=args.n,
            sigma=args.sigma,
            step=step,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
        )
        return time.perf_counter() - t

    timed_hf(0)  # warm-up
    hf_times = []
    for i in range(args.hf_repeats):
        hf_times.append(timed_hf(i + 1))
        print(f"repeat {i}: transformers ncgrpo {hf_times[-1]:.3f}s", file=sys.stderr, flush=True)

    # the plugin's own work, measured in-process on the same shapes (robust to load on a shared CPU):
    # the first-token step perturbs P*n rows of the [P*G, d] rows compute_logits receives
    from ncgrpo.engines.vllm import _perturb_logit_rows, parse_noise_spec
    from ncgrpo.engines.vllm import noise_extra_args as _nea

    specs = [parse_noise_spec(_nea(r)) for r in plan_batch(pids, args.n, args.sigma, args.seed, 1)]
    noisy_rows = [(i, s) for i, s in enumerate(specs) if s is not None]
    hs = torch.randn(len(requests), model.config.hidden_size)
    hook = []
    for _ in range(20):
        t = time.perf_counter()
        _perturb_logit_rows(hs, noisy_rows)
        hook.append(time.perf_counter() - t)
    hook_s = statistics.median(hook)

    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["ncgrpo"], times["vanilla"], strict=True))
    paired0 = statistics.median(a / b for a, b in zip(times["sigma0"], times["vanilla"], strict=True))
    hf_med = statistics.median(hf_times)
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),  # bench_rollout.py's, one description for every benchmark
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_1m": os.getloadavg()[0],
            "device": device,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": vllm.__version__,
            "runner": status[0]["runner"],
        },
        "config": vars(args),
        "params": count_parameters(model),
        "engine_start_s": start_s,
        "rows": len(requests),
        "prompt_tokens": [len(p) for p in ids],
        "vllm_times_s": times,
        "vllm_median_s": med,
        "ratio_ncgrpo_over_vanilla": med["ncgrpo"] / med["vanilla"],
        "paired_ratio_median": paired,
        "ratio_sigma0_over_vanilla": med["sigma0"] / med["vanilla"],
        "paired_ratio_sigma0_median": paired0,
        "plugin_hook_s_per_rollout": hook_s,
        "plugin_in_engine_s": in_engine,
        "plugin_in_engine_median_s": {k: statistics.median(v) for k, v in in_engine.items()},
        "plugin_hook_share_of_vanilla": hook_s / med["vanilla"],
        "transformers_ncgrpo_times_s": hf_times,
        "transformers_ncgrpo_median_s": hf_med,
        "speedup_vllm_over_transformers": hf_med / med["ncgrpo"],
    }
    print(
        f"# bench_vllm_rollout  {result['machine']['cpu']}  vllm {vllm.__version__}  torch {torch.__version__}"
    )
    print(
        f"# size={args.size} params={result['params']['total'] / 1e6:.2f}M  P={args.prompts} G={G} rows={len(requests)} "
        f"new_tokens={args.max_new_tokens} repeats={args.repeats} sigma={args.sigma}"
    )
    print(f"{'method':<34}{'median s':>10}{'min s':>10}{'max s':>10}")
    for k, label in (
        ("vanilla", "vLLM vanilla GRPO"),
        ("ncgrpo", "vLLM NC-GRPO (plugin)"),
        ("sigma0", "vLLM NC-GRPO requests, sigma 0"),
    ):
        print(f"{label:<34}{med[k]:>10.3f}{min(times[k]):>10.3f}{max(times[k]):>10.3f}")
    print(f"{'transformers NC-GRPO (hook)':<34}{hf_med:>10.3f}{min(hf_times):>10.3f}{max(hf_times):>10.3f}")
    print(
        f"ratio vLLM NC-GRPO / vanilla: {result['ratio_ncgrpo_over_vanilla']:.4f} (ratio of medians), "
        f"{paired:.4f} (median of paired ratios)"
    )
    print(
        f"plugin work per rollout (eq. 2 on {len(noisy_rows)} rows, in-process): {1e3 * hook_s:.2f} ms = "
        f"{100 * result['plugin_hook_share_of_vanilla']:.2f}% of the vanilla rollout"
    )
    print(
        f"ratio sigma-0 requests / vanilla: {result['ratio_sigma0_over_vanilla']:.4f} (ratio of medians), "
        f"{paired0:.4f} (median of paired ratios): per-request SamplingParams and extra_args, no noise"
    )
    pe = result["plugin_in_engine_median_s"]
    print(
        f"plugin code inside the worker per rollout: {1e3 * pe['ncgrpo']:.2f} ms NC-GRPO "
        f"({100 * pe['ncgrpo'] / med['vanilla']:.2f}% of the vanilla rollout), {1e3 * pe['vanilla']:.3f} ms vanilla"
    )
    print(f"vLLM speed-up over transformers (NC-GRPO): {result['speedup_vllm_over_transformers']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
