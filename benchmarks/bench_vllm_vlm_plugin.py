"""The ncgrpo vLLM plugin's cost per rollout with IMAGE prompts (a Qwen2.5-VL in vLLM), NC-GRPO vs
vanilla, interleaved in one run. Run in .venv-vllm (scripts/setup_vllm.sh; on a CPU-only torch it
installs torchvision without its C++ operators, which vLLM's Qwen2-VL family needs).

One ``LLM`` on a tiny random Qwen2.5-VL (tests/vlm_fixtures.py: 112-pixel images = 16 image tokens),
prefix caching on as in training. A rollout is one ``LLM.generate`` over P prompts x G rows (n = 1 per
request, as TRL's colocate mode sends them): each prompt is the processor's chat prompt for one image
(the image placeholder collapsed for vLLM, :mod:`ncgrpo.engines.vllm_multimodal`) plus its PIL image.
Arms, rotated so that none always goes first:

- ``vanilla``: every row clean, one shared SamplingParams;
- ``ncgrpo``: the noisy half of each group carries its spec (``latent``, sigma ``--sigma``);
- ``image`` (``--image-arm``): NoisyRollout's method, the noisy half gets the prompt's distorted image
  (one copy per prompt, made before the timer starts); no hidden noise, so this arm's extra cost is
  vLLM's (a second image per prompt to encode, no prefix-cache sharing with the clean half), not the
  plugin's.

The prefix cache is reset before every rollout (TRL resets it after each weight sync), so no arm reuses
another's blocks. ``ignore_eos``: every row decodes exactly ``--max-new-tokens`` tokens. Reported: median
wall time per arm, the ratio of medians and the median of paired ratios (same repeat), and the time the
engine's worker spent inside the plugin's code per rollout (read through its status RPC).

    .venv-vllm/bin/python benchmarks/bench_vllm_vlm_plugin.py --prompts 4 --n 4 --max-new-tokens 32 \
        --repeats 15 --image-arm --out runs/bench_vllm_vlm_plugin_cpu.json
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

QUESTIONS = [
    "What is the area of the triangle?",
    "Find the value of x in the figure. Round to the nearest tenth if necessary.",
    "Which category has the highest value?",
    "Is the line AB parallel to CD?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="clean rows per prompt (G = 2n)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--sigma", type=float, default=0.2)
    p.add_argument("--image-t", type=int, default=300, help="diffusion step of the image arm's distortion")
    p.add_argument("--image-arm", action="store_true", help="also time the image method's rollouts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("prompts", "n", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sigma < 0 or args.image_t < 0:
        p.error("--sigma and --image-t must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import transformers
    import vllm
    from bench_rollout import _cpu_name  # a sibling script, not a package
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    from ncgrpo.core.image_noise import ResizePolicy, distort_images, prompt_image_seed
    from ncgrpo.core.plan import plan_group
    from ncgrpo.engines.vllm import check_plugin_active, sampling_params_for_rows
    from ncgrpo.engines.vllm_multimodal import collapse_vllm_image_prompts, image_token_id_of
    from ncgrpo.methods import get_method
    from vlm_fixtures import image_chat, random_image, save_vllm_qwen2_5_vl

    tmp = tempfile.mkdtemp(prefix="bench_vllm_vlm_")
    folder = save_vllm_qwen2_5_vl(tmp, seed=args.seed)
    proc = AutoProcessor.from_pretrained(folder)
    G = 2 * args.n
    images = [random_image(100 + i) for i in range(args.prompts)]
    prompt_ids = []
    for i, img in enumerate(images):
        text = proc.apply_chat_template(
            image_chat(QUESTIONS[i % len(QUESTIONS)]), add_generation_prompt=True, tokenize=False
        )
        prompt_ids.append(proc(text=[text], images=[img])["input_ids"][0])
    policy = ResizePolicy.from_image_processor(proc.image_processor)
    distorted = [
        distort_images([img], args.image_t, prompt_image_seed(args.seed, 0, i), policy)[0]
        for i, img in enumerate(images)
    ]
    tid = image_token_id_of(proc)

    def requests(arm: str):
        rows = []
        for i, ids in enumerate(prompt_ids):
            for g in range(G):
                img = distorted[i] if arm == "image" and g >= args.n else images[i]
                rows.append({"prompt_token_ids": list(ids), "multi_modal_data": {"image": img}})
        return collapse_vllm_image_prompts(rows, tid)

    t0 = time.perf_counter()
    llm = LLM(
        model=str(folder),
        dtype="float32",
        seed=args.seed,
        max_model_len=512,
        enforce_eager=not torch.cuda.is_available(),
        enable_prefix_caching=True,
        limit_mm_per_prompt={"image": 1, "video": 0},
        **({"kv_cache_memory_bytes": 1 << 26} if not torch.cuda.is_available() else {}),
    )
    status = check_plugin_active(llm)
    start_s = time.perf_counter() - t0
    print(f"engine up in {start_s:.1f}s: {status}", file=sys.stderr, flush=True)

    base = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens, ignore_eos=True)

    def params(arm: str, step: int):
        if arm != "ncgrpo":
            return [base] * (G * args.prompts)
        rows = [
            r
            for pid in range(args.prompts)
            for r in plan_group(args.n, args.sigma, args.seed, step, pid, get_method("latent"))
        ]
        return sampling_params_for_rows(base, rows)

    def rollout(arm: str, step: int) -> tuple[float, float, int]:
        reqs, sp = requests(arm), params(arm, step)
        llm.reset_prefix_cache()
        before = check_plugin_active(llm)[0]
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        after = check_plugin_active(llm)[0]
        assert all(len(o.outputs[0].token_ids) == args.max_new_tokens for o in outs)
        assert all(list(o.prompt_token_ids) == list(prompt_ids[i // G]) for i, o in enumerate(outs))
        return (
            wall,
            after["plugin_seconds"] - before["plugin_seconds"],
            after["perturbed_rows"] - before["perturbed_rows"],
        )

    arms = ["vanilla", "ncgrpo"] + (["image"] if args.image_arm else [])
    for arm in arms:
        rollout(arm, 0)  # warm-up
    wall = {a: [] for a in arms}
    plugin = {a: [] for a in arms}
    perturbed = {a: [] for a in arms}
    for i in range(args.repeats):
        k = i % len(arms)
        for arm in arms[k:] + arms[:k]:
            w, s, r = rollout(arm, i + 1)
            wall[arm].append(w)
            plugin[arm].append(s)
            perturbed[arm].append(r)
            print(f"repeat {i}: {arm} {w:.3f}s plugin {1e3 * s:.2f} ms rows {r}", file=sys.stderr, flush=True)

    med = {a: statistics.median(v) for a, v in wall.items()}
    res = {
        "machine": {
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows_per_rollout": G * args.prompts,
        "prompt_tokens": [len(p) for p in prompt_ids],
        "engine_start_s": start_s,
        "median_s": med,
        "wall_s": wall,
        "plugin_ms_per_rollout": {a: 1e3 * statistics.median(v) for a, v in plugin.items()},
        "perturbed_rows_per_rollout": {a: statistics.median(v) for a, v in perturbed.items()},
    }
    for a in arms[1:]:
        res[f"{a}_over_vanilla"] = {
            "ratio_of_medians": med[a] / med["vanilla"],
            "median_paired_ratio": statistics.median(
                x / y for x, y in zip(wall[a], wall["vanilla"], strict=True)
            ),
        }
    res["plugin_share_of_vanilla_rollout"] = res["plugin_ms_per_rollout"]["ncgrpo"] / 1e3 / med["vanilla"]
    print(json.dumps({k: v for k, v in res.items() if k != "wall_s"}, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp_out.write_text(json.dumps(res, indent=2))
        os.replace(tmp_out, args.out)
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    return res


if __name__ == "__main__":
    main()
