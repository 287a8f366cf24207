"""``ncgrpo demo``: the paper's protocol in miniature on a CPU (flags only; the work is ncgrpo.demo)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = (
    "train vanilla GRPO and NC-GRPO on the embedded synthetic suite, evaluate, and print the paper's tables"
)


def _sigmas(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(  # noqa: B904 -- argparse shows only this message
            f"--sigma0 expects comma-separated numbers such as 0.2,0.5, got {text!r}"
        )
    if not values:
        raise argparse.ArgumentTypeError("--sigma0 needs at least one value")
    return values


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    import dataclasses

    from ncgrpo.demo import DemoConfig  # light: ncgrpo.demo imports torch & co. only inside functions

    d = {f.name: f.default for f in dataclasses.fields(DemoConfig)}  # one source of defaults
    p = subparsers.add_parser(
        "demo",
        help=HELP,
        description=HELP + ". Defaults fit in well under 15 minutes on a 2-core CPU; flags scale it up. "
        "Rerunning into the same --out skips finished runs.",
    )
    add = p.add_argument
    # fmt: off
    add("--out", type=Path, default=d["out"], metavar="DIR", help="output folder (default: %(default)s)")
    add("--steps", type=int, default=d["steps"],
        help="optimizer steps per run, K of eq. (3); k_mid = 40/60 K (default: %(default)s, the paper's)")
    add("--seeds", type=int, default=d["seeds"],
        help="training seeds per configuration; 3 gives the 3-seed table (default: %(default)s)")
    add("--sigma0", type=_sigmas, default=d["sigma0"], metavar="S[,S...]",
        help="NC-GRPO noise scale(s), one run each (default: 0.2; the paper also uses 0.5)")
    add("--all-methods", action="store_true",
        help="also train NoisyRollout (image), antithetic, SPSA and first-token temperature")
    add("--model", type=Path, default=None, metavar="PATH",
        help="base model folder, e.g. a bigger one (default: the embedded tiny base model)")
    add("--cache-dir", type=Path, default=None, metavar="DIR",
        help="where the embedded base model is built and cached if not shipped (default: ~/.cache/ncgrpo)")
    add("--device", default=d["device"], help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    add("--eval-limit", type=int, default=None, metavar="N",
        help="test questions per family (default: the whole test split, 200 per family)")
    add("--num-generations", type=int, default=d["num_generations"], metavar="G",
        help="rollouts per prompt; two-pass methods use G/2 clean + G/2 noisy (default: %(default)s)")
    add("--prompts-per-step", type=int, default=d["prompts_per_step"],
        help="prompts per optimizer step (default: %(default)s)")
    add("--max-completion-length", type=int, default=d["max_completion_length"],
        help="rollout token budget (default: %(default)s)")
    add("--max-new-tokens", type=int, default=d["max_new_tokens"],
        help="evaluation token budget (default: %(default)s)")
    add("--learning-rate", type=float, default=d["learning_rate"], help="(default: %(default)s)")
    add("--noise-site", default=d["noise_site"],
        help="where the hidden-noise methods perturb the prefill: final_norm (the paper's site) or decoder-layer "
             "indices such as 1 or 0,2 (the propagating variant) (default: %(default)s)")
    add("--branch-prefix", default=d["branch_prefix"], metavar="TEXT",
        help="text appended to the training generation prompt so the prefill ends where reasoning begins "
             "(e.g. '<think>'); rewards see it in front of the completion; evaluation uses the plain prompt "
             "(default: %(default)r)")
    add("--val-limit", type=int, default=d["val_limit"], metavar="N",
        help="validation questions per family scored greedily during training; 0 turns it off "
             "(default: %(default)s)")
    add("--val-every", type=int, default=None, metavar="STEPS",
        help="validate every STEPS steps (default: about six times per run)")
    add("--threads", type=int, default=d["num_threads"],
        help="torch CPU threads; 0 leaves torch's default (default: %(default)s, the fastest on a small busy CPU)")
    add("--no-progress", action="store_true", help="no progress bars or tables on the terminal")
    # fmt: on
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import time

    t0 = time.perf_counter()
    # The demo prints its own progress: one bar per training run and per evaluation. Library chatter
    # (weight-loading and parquet bars, TRL's deprecation notices for transformers v6) is silenced.
    import warnings

    import datasets
    import transformers

    from ncgrpo.demo import DemoConfig, run_demo

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        cfg = DemoConfig(
            out=args.out, steps=args.steps, seeds=args.seeds, sigma0=args.sigma0, all_methods=args.all_methods,
            model=args.model, cache_dir=args.cache_dir, device=args.device, eval_limit=args.eval_limit,
            num_generations=args.num_generations, prompts_per_step=args.prompts_per_step,
            max_completion_length=args.max_completion_length, max_new_tokens=args.max_new_tokens,
            learning_rate=args.learning_rate, noise_site=args.noise_site, branch_prefix=args.branch_prefix, val_limit=args.val_limit, val_every=args.val_every,
            num_threads=args.threads or None, progress=not args.no_progress,
        )  # fmt: skip
        result = run_demo(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"ncgrpo demo: error: {e}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"\nnote: {note}")
    print("\nwrote:")
    for key, path in result.files.items():
        print(f"  {key:14s} {path}")
    stages = ", ".join(f"{k} {v:.0f}s" for k, v in result.stage_times_s.items())
    print(f"total wall time: {time.perf_counter() - t0:.0f} s ({stages})")
    return 0
