"""``ncgrpo probe``: does the prefill noise change first tokens and rollouts? (:mod:`ncgrpo.probe`)"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ncgrpo.commands._common import UsageError, add_dataclass_command

HELP = "measure whether NC-GRPO's prefill noise changes first tokens and rollouts, before training"


def _h(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class ProbeArgs:
    """Options of ``ncgrpo probe`` (checked in ``__post_init__``)."""

    model_name_or_path: str | None = field(
        default=None, metadata=_h("model folder or cached hub id (null: the embedded base)")
    )
    benchmark: str = field(
        default="synthetic",
        metadata=_h(
            "where the prompts come from: 'synthetic' (the embedded suite, generated) or a benchmark name "
            "`ncgrpo eval` knows (geo3k, mathvista, ...) read from --data"
        ),
    )
    data: Path | None = field(
        default=None, metadata=_h("data folder of --benchmark (not needed for synthetic)")
    )
    split: str | None = field(
        default=None, metadata=_h("split (null: train for synthetic, the benchmark's own else)")
    )
    family: str = field(
        default="geometry", metadata=_h("synthetic only: the family to probe ('all': every one)")
    )
    prompts: int = field(default=32, metadata=_h("number of prompts N"))
    rollouts: int = field(
        default=4, metadata=_h("noisy rollouts per prompt and sigma (and as many clean partners)")
    )
    sigma0: list[float] = field(
        default_factory=lambda: [0.0, 0.2, 0.5], metadata=_h("noise scales, e.g. --sigma0 0 0.2 0.5")
    )
    noise_site: str = field(
        default="final_norm", metadata=_h("noise site: final_norm or decoder-layer indices '1' / '0,2'")
    )
    noise_layer_decay: float = field(default=0.5, metadata=_h("depth decay across several layer sites"))
    rollout_method: str = field(
        default="latent", metadata=_h("whose draws: latent (independent), antithetic or spsa")
    )
    branch_prefix: str = field(
        default="", metadata=_h("text appended to the generation prompt (e.g. '<think>')")
    )
    temperature: float = field(default=1.0, metadata=_h("sampling temperature (1, as GRPO)"))
    max_completion_length: int = field(default=48, metadata=_h("rollout token budget"))
    batch_size: int = field(default=8, metadata=_h("prompts per generate call"))
    seed: int = field(default=0, metadata=_h("seed of the noise keys and the sampler"))
    marginal_draws: int = field(
        default=1024,
        metadata=_h(
            "Monte Carlo draws of eps per prompt for the noise-averaged first-token distribution q̄ "
            "(final-norm site; through the LM head only)"
        ),
    )
    target_marginal_tv: float | None = field(
        default=None,
        metadata=_h("also find the sigma whose marginal first-token TV reaches this value (final-norm site)"),
    )
    output_file: Path | None = field(default=None, metadata=_h("also write the result as JSON here"))
    device: str = field(default="auto", metadata=_h("cpu, cuda, cuda:N or auto"))
    dtype: str = field(default="auto", metadata=_h("model dtype: auto, float32, bfloat16, float16"))
    num_threads: int = field(default=1, metadata=_h("torch CPU threads (0: torch's default)"))
    progress: bool = field(default=True, metadata=_h("progress bar (--no_progress: none)"))

    def __post_init__(self) -> None:
        from ncgrpo.core.noise import parse_noise_site

        for name in ("prompts", "rollouts", "max_completion_length", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not self.sigma0:
            raise ValueError("--sigma0 needs at least one noise scale")
        parse_noise_site(self.noise_site)
        if self.num_threads < 0:
            raise ValueError(f"--num_threads must be >= 0 (0: torch's default), got {self.num_threads}")
        from ncgrpo.models import check_device

        check_device(self.device)  # before the model loads
        if self.data is not None:
            self.data = Path(self.data)
        if self.output_file is not None:
            self.output_file = Path(self.output_file)


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_dataclass_command(sub, "probe", ProbeArgs, run, help=HELP, description=HELP)


def _questions(args: ProbeArgs) -> list:
    if args.benchmark == "synthetic" and args.data is None:
        from ncgrpo.toy.synthetic import build_suite

        split = args.split or "train"
        sizes = {split: max(args.prompts, 1)} if split == "train" else None
        qs = build_suite(0, sizes)[split]
        if args.family != "all":
            qs = [q for q in qs if q.metadata["family"] == args.family]
            if not qs:
                raise UsageError(f"no synthetic questions of family {args.family!r} in split {split!r}")
        return qs[: args.prompts]
    from ncgrpo.commands.eval import load_questions

    return load_questions([args.benchmark], {args.benchmark: args.data}, args.split, args.prompts)


def run(args: ProbeArgs) -> int:
    import torch
    from rich.console import Console

    from ncgrpo.core.noise import parse_noise_site
    from ncgrpo.models import load_model_and_processor
    from ncgrpo.probe import format_probe, probe

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.model_name_or_path is None:
        from ncgrpo.toy.pretrain import ensure_base_model

        path = str(ensure_base_model())
    else:
        path = args.model_name_or_path
    questions = _questions(args)
    model, processor = load_model_and_processor(path, dtype=args.dtype, device=args.device)
    result = probe(
        model, processor, questions, args.sigma0, rollouts=args.rollouts,
        site=parse_noise_site(args.noise_site), layer_decay=args.noise_layer_decay,
        branch_prefix=args.branch_prefix, method=args.rollout_method, temperature=args.temperature,
        max_new_tokens=args.max_completion_length, batch_size=args.batch_size,
        seed=args.seed, model_name=path, progress=args.progress, marginal_draws=args.marginal_draws,
        target_marginal_tv=args.target_marginal_tv,
    )  # fmt: skip
    Console(width=max(Console().width, 160)).print(format_probe(result))
    if args.output_file is not None:
        result.to_json(args.output_file)
        print(f"wrote {args.output_file}")
    return 0
