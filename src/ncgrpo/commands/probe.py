"""``ncgrpo probe``: does the prefill noise change first tokens and rollouts? (:mod:`ncgrpo.probe`)"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "measure whether NC-GRPO's prefill noise changes first tokens and rollouts, before training"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help=HELP, description=HELP)
    p.add_argument(
        "--model", default=None, help="model folder or cached hub id (default: the embedded base model)"
    )
    p.add_argument(
        "--benchmark",
        default="synthetic",
        help="where the prompts come from: 'synthetic' (the embedded suite, generated; default), or a benchmark "
        "name `ncgrpo eval` knows (geo3k, mathvista, ...) read from --data",
    )
    p.add_argument(
        "--data", type=Path, default=None, help="data folder of --benchmark (not needed for synthetic)"
    )
    p.add_argument(
        "--split", default=None, help="split (default: train for synthetic, the benchmark's own else)"
    )
    p.add_argument(
        "--family",
        default="geometry",
        help="synthetic only: family to probe ('all': every one; default geometry)",
    )
    p.add_argument("--prompts", type=int, default=32, help="number of prompts N (default 32)")
    p.add_argument("--rollouts", type=int, default=4, help="noisy rollouts per prompt and sigma (default 4)")
    p.add_argument("--sigma", default="0,0.2,0.5", help="comma-separated noise scales (default 0,0.2,0.5)")
    p.add_argument(
        "--site", default="final_norm", help="noise site: final_norm or decoder-layer indices '1' / '0,2'"
    )
    p.add_argument("--layer-decay", type=float, default=0.5, help="depth decay across several layer sites")
    p.add_argument("--mode", default="independent", choices=("independent", "antithetic", "rank_one"))
    p.add_argument(
        "--branch-prefix", default="", metavar="TEXT", help="text appended to the generation prompt"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1, as GRPO)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _questions(args: argparse.Namespace) -> list:
    if args.benchmark == "synthetic" and args.data is None:
        from ncgrpo.data.synthetic import build_suite

        split = args.split or "train"
        sizes = {split: max(args.prompts, 1)} if split == "train" else None
        qs = build_suite(0, sizes)[split]
        if args.family != "all":
            qs = [q for q in qs if q.metadata["family"] == args.family]
            if not qs:
                raise SystemExit(f"no synthetic questions of family {args.family!r} in split {split!r}")
        return qs[: args.prompts]
    from ncgrpo.commands.eval import load_questions

    return load_questions([args.benchmark], {args.benchmark: args.data}, args.split, args.prompts)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from ncgrpo.models.loading import load_model_and_processor
    from ncgrpo.probe import format_probe, probe
    from ncgrpo.trainer import parse_noise_site

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        sigmas = [float(s) for s in args.sigma.split(",") if s.strip()]
        site = parse_noise_site(args.site)
    except ValueError as e:
        raise SystemExit(f"ncgrpo probe: {e}") from None
    if args.model is None:
        from ncgrpo.pretrain import ensure_base_model

        path = str(ensure_base_model())
    else:
        path = args.model
    questions = _questions(args)
    model, processor = load_model_and_processor(path, dtype=args.dtype, device=args.device)
    try:
        result = probe(
            model, processor, questions, sigmas, rollouts=args.rollouts, site=site, layer_decay=args.layer_decay,
            branch_prefix=args.branch_prefix, mode=args.mode, temperature=args.temperature,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed, model_name=path,
            progress=not args.no_progress,
        )  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"ncgrpo probe: {e}") from None
    Console(width=max(Console().width, 160)).print(format_probe(result))
    if args.out is not None:
        result.to_json(args.out)
        print(f"wrote {args.out}")
    return 0
