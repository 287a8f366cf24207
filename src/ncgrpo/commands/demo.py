"""``ncgrpo demo [--config demo.yaml] [--FIELD VALUE ...]``: the paper's protocol in miniature on a CPU.

Argument parsing only: every field of :class:`ncgrpo.toy.demo_config.DemoConfig` is a flag and a config key
(``ncgrpo demo --help``); the work is :func:`ncgrpo.toy.demo.run_demo`.
"""

from __future__ import annotations

import argparse
import time

HELP = (
    "train vanilla GRPO and NC-GRPO on the embedded synthetic suite, evaluate, and print the paper's tables"
)


def _dataclasses():
    from ncgrpo.toy.demo_config import DemoConfig

    return (DemoConfig,)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help=HELP,
        description=HELP + ". Defaults take 206.8 s (3.5 minutes) on 2 idle CPU cores; flags scale it up.",
        dataclass_types=_dataclasses,
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from ncgrpo.toy.demo import quiet_libraries, run_demo
    from ncgrpo.toy.demo_config import DemoConfig

    quiet_libraries()
    result = run_demo(args.parsed_config.build(DemoConfig))
    for note in result.notes:
        print(f"\nnote: {note}")
    print("\nwrote:")
    for key, path in result.files.items():
        print(f"  {key:14s} {path}")
    stages = ", ".join(f"{k} {v:.0f}s" for k, v in result.stage_times_s.items())
    print(f"total wall time: {time.perf_counter() - t0:.0f} s ({stages})")
    return 0
