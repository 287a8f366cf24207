"""Optimizer-step time of NC-GRPO's rollout methods vs vanilla GRPO at the same group size G.

One process, one model (random weights, built once from a config and deep-copied for every run so
every run starts from identical weights), the same image prompts, the same seed and the same
``num_generations = G``. Each method trains for ``--steps`` optimizer steps with
``NCGRPOTrainer`` (TRL 1.16's ``GRPOTrainer`` plus the generation seam); the runs are INTERLEAVED
(round r runs every method once, in an order rotated by r) over ``--repeats`` rounds, so load on a
shared machine hits all methods alike. A ``TrainerCallback`` stamps wall and process-CPU time at
``on_step_begin`` / ``on_step_end`` (generation, rewards, loss, backward and the optimizer; not
logging); the first step of every run is warm-up and is not counted.

Fair lengths: at random init, sampled completion LENGTHS differ between methods and would dominate
step time. Every row is therefore forced to decode exactly ``--max-completion-length`` tokens
(``generation_kwargs={"min_new_tokens": max_completion_length}``: EOS is masked until the cap), and
the logged ``completions/min_length`` / ``max_length`` are checked against it.

Where time goes: TRL's own profiling (``trl.extras.profiling.ProfilingContext``; normally sent only
to wandb/mlflow/trackio) is captured per step -- ``transformers.generate`` (the ``model.generate``
call), ``_prepare_inputs`` (generation + rewards + advantages), ``compute_loss`` -- plus two seams
of NCGRPOTrainer: ``_generate_single_turn`` (so ``seam = _generate_single_turn - generate`` is the
method's own rollout overhead: per-row noise plans and keys, hook set-up, and for ``image`` the
diffusion distortion and re-processing of the images) and ``_nc_after_rewards`` (NC-GRPO's metrics:
clean/noisy rewards, contrast, first-token divergence, agreement kernel; SPSA's mu update).

Precision and recipe: on CPU the Trainer runs without autocast (``--amp auto``): TRL 1.16 defaults
to ``bf16=True``, and bf16 autocast on a CPU without avx512_bf16/AMX made a ``small`` step take
~13x the CPU time (23.4 s vs 1.8 s), which would bury every method difference. The vision tower is frozen
(the paper's section 4.1; ``--train-vision`` to train it); gradient checkpointing is TRL's default
(on). On a shared CPU use ``--threads 1``: with 2 OpenMP threads on an oversubscribed machine
every matmul waits on the slower thread.

    python benchmarks/bench_train.py --size tiny --steps 6 --repeats 12 --threads 1
    python benchmarks/bench_train.py --size small --image-size 112 --steps 4 --repeats 5 --threads 1
    python benchmarks/bench_train.py --device cuda --size 0.5b --G 8 --prompts-per-step 4 \
        --max-completion-length 256 --image-size 448 --steps 4 --repeats 3 \
        --methods vanilla,latent,image,antithetic,spsa,first_token_temperature

Targets (issue 24): with ``share_prompt_prefill`` (one vision pass and one prompt prefill per prompt,
the default) latent / vanilla < 1.0 at the small size with image prompts and G = 8; ``latent:noshare``
(one prefill per row, as TRL) / vanilla <= 1.02. ``vanilla`` is TRL's path: one prefill per row, no hook.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import SIZES as ROLLOUT_SIZES  # noqa: E402  (a sibling script, not a package)
from bench_rollout import (
    SMALL_VISION,  # noqa: E402
    process_age,  # noqa: E402
)
from bench_rollout import machine as rollout_machine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Qwen2.5 text towers (random weights); "tiny" is tests/scripts/tiny_grpo.py's model as is.
SIZES = {
    "tiny": dict(),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "0.5b": ROLLOUT_SIZES["0.5b"],
    "1.5b": ROLLOUT_SIZES["1.5b"],
}
STEP_KEYS = ("generate", "seam", "solve", "nc_after_rewards", "prepare_inputs", "compute_loss", "rest")


def _tiny_grpo():
    """tests/scripts/tiny_grpo.py (the trainer tests' builders), loaded by path: tests/ is no package."""
    if "tiny_grpo" in sys.modules:
        return sys.modules["tiny_grpo"]
    path = REPO / "tests" / "scripts" / "tiny_grpo.py"
    spec = importlib.util.spec_from_file_location("tiny_grpo", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_grpo"] = mod
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    from ncgrpo.methods import method_names

    ROLLOUT_METHODS = method_names()

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype"
    )
    p.add_argument(
        "--amp",
        default="auto",
        choices=["auto", "no", "bf16", "fp16"],
        help="Trainer autocast (TRL's bf16/fp16 fields). auto: bf16 on CUDA with float32 weights (TRL 1.16's "
        "default), none on CPU (CPU bf16 autocast without avx512_bf16/AMX makes every matmul many times slower)",
    )
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument(
        "--methods",
        default="vanilla,latent,latent:noshare,image",
        help="comma-separated rollout methods (vanilla is always added as the baseline: TRL's path, one prefill "
        f"per row, no hook); any of {', '.join(ROLLOUT_METHODS)}, each optionally with ':noshare' "
        "(share_prompt_prefill=False: one prefill per row, as TRL), ':shareloss' (share_prompt_loss=True) or "
        "':target' (the target schedule at --target-tv: sigma_k solved every step), ':target_prompt' (the same, "
        "each prompt's own sigma: target_scope prompt) or ':nometric' "
        "(marginal_tv_draws 0: no noise/first_token_marginal_tv, the metric's cost by difference)",
    )
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each runs every method once)")
    p.add_argument("--G", type=int, default=8, help="num_generations (group size G = 2n)")
    p.add_argument(
        "--prompts-per-step", type=int, default=2, help="prompts per optimizer step (batch = P * G rows)"
    )
    p.add_argument(
        "--max-completion-length", type=int, default=32, help="every row decodes exactly this many tokens"
    )
    p.add_argument("--image-size", type=int, default=56, help="image side in pixels (56: tiny_grpo's images)")
    p.add_argument(
        "--sigma0", type=float, default=0.2, help="noise scale (constant schedule, so it is on every step)"
    )
    p.add_argument(
        "--target-tv",
        type=float,
        default=0.002,
        help="':target' runs: target_marginal_tv (constant; 0.002 is reached near sigma 0.3 on the random tiny "
        "model), sigma_max 10",
    )
    p.add_argument(
        "--image-noise-step", type=int, default=500, help="image method's diffusion step t (constant)"
    )
    p.add_argument(
        "--train-vision",
        action="store_true",
        help="also train the vision tower (default: frozen, as the paper's section 4.1 and NoisyRollout)",
    )
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--out", default="runs/bench_train.json", help="JSON output path")
    p.add_argument(
        "--time-cap",
        type=float,
        default=0.0,
        help="seconds from the process's start (imports and the model's build included; 0: no cap): no run "
        "starts that the last run's length says would end past it (the first round's vanilla run always "
        "starts); the summary prints the rounds that ran",
    )
    args = p.parse_args(argv)
    if args.time_cap < 0:
        p.error("--time-cap must be >= 0")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if split_method(m)[0] not in ROLLOUT_METHODS or m.count(":") > 1]
    bad += [m for m in methods if ":" in m and m.partition(":")[2] not in VARIANTS]
    if bad:
        p.error(f"--methods: unknown {bad}; use any of {', '.join(ROLLOUT_METHODS)}")
    if args.amp == "auto":
        args.amp = "bf16" if args.device.startswith("cuda") and args.dtype == "float32" else "no"
    args.methods = ["vanilla"] + [m for m in dict.fromkeys(methods) if m != "vanilla"]
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step of every run is warm-up and not timed)")
    if args.repeats < 1 or args.G < 2 or args.prompts_per_step < 1 or args.max_completion_length < 1:
        p.error("--repeats, --prompts-per-step and --max-completion-length must be >= 1 and --G >= 2")
    return args


#: a method's variants: ``method:variant``
VARIANTS = ("noshare", "shareloss", "target", "target_prompt", "nometric")


def split_method(spec: str) -> tuple[str, bool]:
    """``"latent"`` -> ``("latent", True)``; ``"latent:noshare"`` -> ``("latent", False)`` (share_prompt_prefill)."""
    name, _, flag = spec.partition(":")
    if flag not in ("", *VARIANTS):
        return name, True  # refused by parse_args
    return name, flag != "noshare"


def machine(device: torch.device) -> dict:
    """bench_rollout.py's machine description (same keys), plus trl / accelerate versions."""
    import accelerate
    import trl

    return {**rollout_machine(device), "trl": trl.__version__, "accelerate": accelerate.__version__}


# --------------------------------------------------------------------------------------------------
# Instrumentation
# --------------------------------------------------------------------------------------------------
class Recorder:
    """Per-step wall / CPU stamps and section times of the run in progress (keyed by 0-based step)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.trainer = None
        self.steps: dict[int, dict] = {}
        self.sections: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, name: str, seconds: float, step: int | None = None) -> None:
        if self.trainer is None:
            return
        step = int(self.trainer.state.global_step) if step is None else step
        self.sections[step][name] += seconds

    def reset(self, trainer) -> None:
        self.trainer = trainer
        self.steps = {}
        self.sections = defaultdict(lambda: defaultdict(float))


@contextlib.contextmanager
def trl_profiling(rec: Recorder):
    """Capture TRL's ``profiling_context`` / ``profiling_decorator`` timings (names without the class).

    TRL only forwards them to wandb/mlflow/trackio; here ``_log_metrics`` also hands them to ``rec``
    (and ``__enter__`` / ``__exit__`` synchronise CUDA so a section's time is its device time).
    """
    from trl.extras.profiling import ProfilingContext

    orig_enter, orig_exit, orig_log = (
        ProfilingContext.__enter__,
        ProfilingContext.__exit__,
        ProfilingContext._log_metrics,
    )

    def enter(self):
        rec.sync()
        return orig_enter(self)

    def exit_(self, *exc):
        rec.sync()
        return orig_exit(self, *exc)

    def log(self, duration):
        rec.add(self.name.split(".", 1)[-1], duration, self.step)
        return orig_log(self, duration)

    ProfilingContext.__enter__, ProfilingContext.__exit__, ProfilingContext._log_metrics = enter, exit_, log
    try:
        yield
    finally:
        ProfilingContext.__enter__, ProfilingContext.__exit__, ProfilingContext._log_metrics = (
            orig_enter,
            orig_exit,
            orig_log,
        )


def _time_method(trainer, attr: str, rec: Recorder) -> None:
    """Wrap ``trainer.<attr>`` (instance attribute) so each call's synchronised wall time goes to ``rec``."""
    inner = getattr(trainer, attr)

    def wrapped(*a, **kw):
        rec.sync()
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            rec.sync()
            rec.add(attr, time.perf_counter() - t)

    setattr(trainer, attr, wrapped)


def step_timer(rec: Recorder):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall and process-CPU seconds of each optimizer step (``on_step_begin`` -> ``on_step_end``)."""

        def on_step_begin(self, args, state, control, **kw):
            rec.sync()
            rec.steps[state.global_step] = {"t": time.perf_counter(), "c": time.process_time()}

        def on_step_end(self, args, state, control, **kw):
            rec.sync()
            s = rec.steps[state.global_step - 1]
            s["wall"] = time.perf_counter() - s.pop("t")
            s["cpu"] = time.process_time() - s.pop("c")

    return StepTimer()


# --------------------------------------------------------------------------------------------------
# Model, data, one run
# --------------------------------------------------------------------------------------------------
def build(args, dtype: torch.dtype):
    """(model on CPU, processor, dataset): tiny_grpo's prompts/reward, a model of ``--size``."""
    from PIL import Image

    from ncgrpo.toy.model import build_processor, build_tokenizer, tiny_qwen2_5_vl

    tg = _tiny_grpo()
    if args.image_size == 56:
        proc = tg.processor()
    else:
        proc = build_processor(build_tokenizer(), image_size=args.image_size)
    overrides = dict(SIZES[args.size])
    if args.size != "tiny":
        overrides.update(SMALL_VISION)
    model = tiny_qwen2_5_vl(processor=proc, seed=args.seed, **overrides).to(dtype=dtype)
    if not args.train_vision:
        from ncgrpo.models import freeze_vision_tower

        freeze_vision_tower(model)  # the paper's recipe (section 4.1); deep copies keep requires_grad
    n_prompts = args.prompts_per_step * args.steps  # every step of a run sees new prompts
    ds = tg.dataset(n_prompts)
    if args.image_size != 56:
        s = args.image_size
        ds = ds.map(lambda row: {"images": [im.resize((s, s), Image.BICUBIC) for im in row["images"]]})
    return model, proc, ds


def one_run(spec: str, steps: int, base_model, proc, ds, args, device, rec: Recorder) -> dict:
    """Train ``steps`` optimizer steps with ``spec`` (a method, ``:noshare`` for one prefill per row) from
    ``base_model``'s weights; per-step records."""
    from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer

    method, share = split_method(spec)
    tg = _tiny_grpo()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as out_dir:
        cfg = NCGRPOConfig(
            **tg.config_kwargs(
                out_dir,
                rollout_method=method,
                per_device_train_batch_size=args.prompts_per_step * args.G,
                num_generations=args.G,
                max_completion_length=args.max_completion_length,
                generation_kwargs={"min_new_tokens": args.max_completion_length},
                max_steps=steps,
                learning_rate=args.learning_rate,
                use_cpu=device.type == "cpu",
                seed=args.seed,
                sigma0=args.sigma0,
                sigma_schedule="constant",
                image_noise_step=args.image_noise_step,
                share_prompt_prefill=share,
                share_prompt_loss=spec.endswith(":shareloss"),
                target_marginal_tv=args.target_tv if spec.endswith((":target", ":target_prompt")) else None,
                target_scope="prompt" if spec.endswith(":target_prompt") else "batch",
                marginal_tv_draws=0 if spec.endswith(":nometric") else 64,
                sigma_max=10.0,
                bf16=args.amp == "bf16",
                fp16=args.amp == "fp16",
                disable_tqdm=True,
            )
        )
        model = copy.deepcopy(base_model)
        trainer = NCGRPOTrainer(
            model=model,
            reward_funcs=[tg.hash_reward],
            args=cfg,
            train_dataset=ds,
            processing_class=proc,
            callbacks=[step_timer(rec)],
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the per-step log dicts; kept in state.log_history
        _time_method(trainer, "_generate_single_turn", rec)
        _time_method(trainer, "_nc_after_rewards", rec)
        rec.reset(trainer)
        trainer_args = {
            k: getattr(cfg, k)
            for k in (
                "gradient_checkpointing",
                "loss_type",
                "beta",
                "per_device_train_batch_size",
                "steps_per_generation",
                "temperature",
                "bf16",
                "fp16",
            )
        }
        import ncgrpo.trainer.target as target_module

        solve = target_module._solve_scoped  # the target schedule's solve (inside generate's prefill)

        def timed_solve(*a, **kw):
            t = time.perf_counter()
            try:
                return solve(*a, **kw)
            finally:
                rec.add("target_solve", time.perf_counter() - t)

        target_module._solve_scoped = timed_solve
        try:
            trainer.train()
        finally:
            target_module._solve_scoped = solve
        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    rows = []
    for k in sorted(rec.steps):
        st, sec = rec.steps[k], rec.sections[k]
        generate = sec.get("transformers.generate", 0.0)
        prep = sec.get("_prepare_inputs", 0.0)
        loss = sec.get("compute_loss", 0.0)
        lg = logs[k] if k < len(logs) else {}
        rows.append(
            {
                "step": k,
                "wall": st["wall"],
                "cpu": st["cpu"],
                "generate": generate,
                "seam": sec.get("_generate_single_turn", 0.0) - generate,
                "solve": sec.get("target_solve", 0.0),  # inside generate (its prefill)
                "nc_after_rewards": sec.get("_nc_after_rewards", 0.0),
                "prepare_inputs": prep,
                "compute_loss": loss,
                "rest": st["wall"] - prep - loss,  # backward, clipping, optimizer step
                "len_min": lg.get("completions/min_length"),
                "len_max": lg.get("completions/max_length"),
            }
        )
    rec.trainer = None
    del trainer, model
    return {"method": spec, "steps": rows, "trainer_args": trainer_args}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def bootstrap_ratio_ci(xs, ys, *, seed: int = 0, n: int = 2000) -> list[float]:
    """95% percentile-bootstrap interval of median(xs) / median(ys) (steps resampled within each method)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    mx = np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)  # [n]
    my = np.median(y[rng.integers(0, len(y), (n, len(y)))], axis=1)  # [n]
    lo, hi = np.percentile(mx / my, [2.5, 97.5])
    return [float(lo), float(hi)]


def paired_ratio(runs: list[dict], method: str, key: str) -> float:
    """Median over rounds of (method's median timed step / vanilla's, same round): removes slow drift."""
    ratios = []
    for r in sorted({run["round"] for run in runs}):
        med = {run["method"]: _median(s[key] for s in run["steps"][1:]) for run in runs if run["round"] == r}
        if method in med and "vanilla" in med:  # a round the time cap cut short may lack either
            ratios.append(med[method] / med["vanilla"])
    return _median(ratios)


def main(argv=None) -> dict:
    from ncgrpo.toy.model import count_parameters

    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    base_model, proc, ds = build(args, dtype)
    build_s = time.perf_counter() - t0
    print(f"built {args.size} in {build_s:.1f}s", file=sys.stderr, flush=True)
    rec = Recorder(device)

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    runs: list[dict] = []
    cut: list[str] = []
    # the cap counts from the process's start when run as a script (from here when called)
    t_runs, last = time.perf_counter() - (process_age() if argv is None else 0.0), 0.0
    with trl_profiling(rec):
        for r in range(args.repeats):
            order = args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]
            for m in order:
                if runs and args.time_cap and time.perf_counter() - t_runs + last > args.time_cap:
                    cut.append(
                        f"round {r}: stopped before {m} ({len(runs)} runs done; --time-cap {args.time_cap:g}s)"
                    )
                    break
                t = time.perf_counter()
                run = one_run(m, args.steps, base_model, proc, ds, args, device, rec)
                run["round"] = r
                runs.append(run)
                walls = " ".join(f"{s['wall']:.2f}" for s in run["steps"])
                last = time.perf_counter() - t
                print(
                    f"round {r}: {m:<24} step wall s [{walls}]  ({last:.1f}s with set-up)",
                    file=sys.stderr,
                    flush=True,
                )
            if cut:
                break
    ran = [m for m in args.methods if any(run["method"] == m for run in runs)]

    # aggregate: timed steps = all but the first of each run
    per: dict[str, dict] = {}
    for m in ran:
        timed = [s for run in runs if run["method"] == m for s in run["steps"][1:]]
        every = [s for run in runs if run["method"] == m for s in run["steps"]]
        per[m] = {
            "wall_s": [s["wall"] for s in timed],
            "cpu_s": [s["cpu"] for s in timed],
            "median_wall_s": _median(s["wall"] for s in timed),
            "min_wall_s": min(s["wall"] for s in timed),
            "max_wall_s": max(s["wall"] for s in timed),
            "median_cpu_s": _median(s["cpu"] for s in timed),
            "median_sections_s": {k: _median(s[k] for s in timed) for k in STEP_KEYS},
            "completion_length_min": min(
                (s["len_min"] for s in every if s["len_min"] is not None), default=None
            ),
            "completion_length_max": max(
                (s["len_max"] for s in every if s["len_max"] is not None), default=None
            ),
        }
    base = per["vanilla"]
    for m, d in per.items():
        d["ratio_wall"] = d["median_wall_s"] / base["median_wall_s"]
        d["ratio_cpu"] = d["median_cpu_s"] / base["median_cpu_s"]
        d["ratio_wall_ci95"] = bootstrap_ratio_ci(d["wall_s"], base["wall_s"], seed=args.seed)
        d["ratio_cpu_ci95"] = bootstrap_ratio_ci(d["cpu_s"], base["cpu_s"], seed=args.seed)
        d["paired_ratio_wall"] = paired_ratio(runs, m, "wall")
        d["paired_ratio_cpu"] = paired_ratio(runs, m, "cpu")
    lengths_ok = all(
        d["completion_length_min"] == d["completion_length_max"] == args.max_completion_length
        for d in per.values()
        if d["completion_length_min"] is not None
    )
    result = {
        "machine": machine(device),
        "config": vars(args),
        "params": count_parameters(base_model),
        "build_s": build_s,
        "load_avg_1m_before": load_before,
        "trainer_args": runs[0]["trainer_args"],
        "rows_per_step": args.prompts_per_step * args.G,
        "equal_lengths": {
            "how": "generation_kwargs={'min_new_tokens': max_completion_length} (EOS masked until the cap)",
            "all_rows_at_cap": lengths_ok,
        },
        "timed_steps_per_method": len(base["wall_s"]),
        "rounds_done": len({run["round"] for run in runs}),
        "time_cap_s": args.time_cap or None,
        "cut_by_time_cap": cut,
        "methods_not_run": [m for m in args.methods if m not in ran],
        "methods": per,
        "runs": runs,
    }

    mach = result["machine"]
    print(
        f"# bench_train  {mach['device_name']}  ({mach['cpu_count']} CPUs, load {mach['load_avg_1m']})  "
        f"torch {mach['torch']}  transformers {mach['transformers']}  trl {mach['trl']}  weights {args.dtype}, autocast {args.amp}"
    )
    print(
        f"# size={args.size} params={result['params']['total'] / 1e6:.2f}M  G={args.G} "
        f"prompts/step={args.prompts_per_step} rows/step={result['rows_per_step']} "
        f"completion={args.max_completion_length} tokens (forced: min_new_tokens; all rows at cap: {lengths_ok}) "
        f"image={args.image_size}px  steps/run={args.steps} (first is warm-up) repeats={args.repeats} "
        f"timed steps/method={result['timed_steps_per_method']}  vision tower "
        f"{'trained' if args.train_vision else 'frozen'}  gradient_checkpointing="
        f"{result['trainer_args']['gradient_checkpointing']} (TRL default)"
    )
    for c in cut:
        print(f"# cut by the time cap: {c}; methods not run: {result['methods_not_run'] or 'none'}")

    def ci(c):
        return f"[{c[0]:.3f}, {c[1]:.3f}]"

    print(
        f"{'method':<24}{'median s':>9}{'min s':>8}{'max s':>8}{'x vanilla':>10}{'95% CI':>17}{'paired':>8}"
        f"{'CPU s':>8}{'x vanilla':>10}{'95% CI':>17}{'paired':>8}"
    )
    for m, d in per.items():
        print(
            f"{m:<24}{d['median_wall_s']:>9.3f}{d['min_wall_s']:>8.3f}{d['max_wall_s']:>8.3f}"
            f"{d['ratio_wall']:>10.3f}{ci(d['ratio_wall_ci95']):>17}{d['paired_ratio_wall']:>8.3f}"
            f"{d['median_cpu_s']:>8.3f}{d['ratio_cpu']:>10.3f}{ci(d['ratio_cpu_ci95']):>17}{d['paired_ratio_cpu']:>8.3f}"
        )
    print(
        "# wall s / CPU s: median wall / process-CPU seconds per timed optimizer step; x vanilla: ratio of medians "
        "with a 95% bootstrap interval; paired: median over rounds of the same-round ratio"
    )
    print(f"{'where time goes (median s)':<28}" + "".join(f"{k:>18}" for k in STEP_KEYS))
    for m, d in per.items():
        s = d["median_sections_s"]
        print(f"{m:<28}" + "".join(f"{s[k]:>18.4f}" for k in STEP_KEYS))
    print(
        "# generate = TRL's transformers.generate (includes the prefill noise hook); seam = NCGRPOTrainer."
        "_generate_single_turn minus generate (row plans, hook set-up, image distortion + re-processing); "
        "nc_after_rewards = NC-GRPO's metrics / SPSA update; prepare_inputs = TRL _prepare_inputs (generation, "
        "rewards, advantages); compute_loss = TRL compute_loss (forward); rest = step - prepare_inputs - "
        "compute_loss (backward, clipping, optimizer)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
