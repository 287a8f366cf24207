"""``ncgrpo pretrain --output_dir DIR [--config pretrain.yaml] [--FIELD VALUE ...]``: build the embedded base model.

Argument parsing only: every field of :class:`ncgrpo.toy.base_model.PretrainConfig` is a flag and a config
key (``ncgrpo pretrain --help``); the work is :func:`ncgrpo.toy.base_model.run_pretrain`.

Supervised warm-up of a tiny Qwen2.5-VL on the synthetic suite's reasoning traces (see
:mod:`ncgrpo.toy.pretrain`), then (with ``--eval``) greedy accuracy per family on the suite's validation
split and the share of in-domain groups with mixed rewards, printed as a table and written to
``DIR/pretrain.json`` next to the model and processor.
"""

from __future__ import annotations

import argparse

HELP = "build the embedded tiny base VL model by supervised warm-up on the synthetic suite"


def _dataclasses():
    from ncgrpo.toy.base_model import PretrainConfig

    return (PretrainConfig,)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("pretrain", help=HELP, description=HELP, dataclass_types=_dataclasses)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm.auto import tqdm

    from ncgrpo.toy.base_model import PretrainConfig, run_pretrain
    from ncgrpo.toy.pretrain import MIXED_GROUP_TARGET, TARGET_BAND

    cfg = args.parsed_config.build(PretrainConfig)
    console = Console()
    with tqdm(
        total=cfg.max_steps + cfg.focus_steps + cfg.final_steps,
        desc="pretrain",
        unit="step",
        disable=not cfg.progress,
    ) as bar:

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        report = run_pretrain(cfg, progress)

    params = report.parameters
    console.print(
        f"saved {cfg.output_dir} | {params['total']:,} parameters (vision {params.get('vision', 0):,}) | "
        f"{report.checkpoint_bytes / 1e6:.1f} MB | train {report.train_time_s:.0f} s, "
        f"total {report.wall_time_s:.0f} s | final loss {report.losses[-1]:.3f}"
    )
    if not cfg.eval:
        return 0
    table = Table(title=f"base model on the validation split (suite seed {report.suite_seed})")
    table.add_column("family")
    table.add_column("n", justify="right")
    table.add_column("greedy acc", justify="right")
    table.add_column(f"sampled acc (T=1, G={report.group_size})", justify="right")
    table.add_column("mixed groups", justify="right")
    for fam, acc in report.accuracy.items():
        table.add_row(
            fam,
            str(report.eval_questions.get(fam, "")),
            f"{100 * acc:.1f}%",
            f"{100 * report.sample_accuracy[fam]:.1f}%" if fam in report.sample_accuracy else "",
            f"{100 * report.mixed_share[fam]:.1f}%" if fam in report.mixed_share else "",
        )
    console.print(table)
    lo, hi = TARGET_BAND
    console.print(
        f"in-domain greedy accuracy in [{100 * lo:.0f}%, {100 * hi:.0f}%]: "
        f"{'[green]yes' if report.in_band else '[red]no'}[/]; "
        f"mixed-reward groups >= {100 * MIXED_GROUP_TARGET:.0f}%: "
        f"{'[green]yes' if report.mixed_ok else '[red]no'}[/]"
    )
    return 0
