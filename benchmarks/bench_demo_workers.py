"""Wall time of ``ncgrpo demo`` with its runs one after the other (``--workers 1``) vs in worker
processes side by side (``--workers N``), and a check that both give the same records.

The embedded base model and the demo's own pipeline (suite, base evaluation, GRPO training of
vanilla and NC-GRPO, greedy evaluation, report), scaled down with ``--steps`` and ``--eval-limit``
so one round fits in minutes. The settings are INTERLEAVED (round r runs each once, in an order
rotated by r) over ``--repeats`` rounds, each into a fresh folder (the suite, built once, is copied
in), so load on a shared machine hits both alike. Reported: the demo's wall time and its
``train_eval`` stage (training and evaluation of the runs, the part the workers split), median over
rounds, and the ratio parallel / sequential. Every round's per-question records and accuracies must
equal the first round's, whatever the number of workers; the script fails if they do not.

    python benchmarks/bench_demo_workers.py --steps 20 --eval-limit 100 --repeats 2 \
        --out runs/bench_demo_workers.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from ncgrpo.toy.demo import run_demo
from ncgrpo.toy.demo_config import DemoConfig


def _records(result) -> dict[str, bytes]:
    return {r.eval_dir.name: (r.eval_dir / "records.jsonl").read_bytes() for r in result.runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    ap.add_argument("--eval-limit", type=int, default=100, help="test questions per family")
    ap.add_argument("--workers", type=int, default=2, help="the parallel setting's worker processes")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; each runs both settings once")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    settings = {"sequential": 1, "parallel": args.workers}
    walls: dict[str, list[float]] = {k: [] for k in settings}
    stages: dict[str, list[float]] = {k: [] for k in settings}
    reference: dict[str, bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="bench_demo_") as tmp:
        suite = None
        for r in range(args.repeats):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in order:
                out = Path(tmp) / f"{name}-{r}"
                if suite is not None:
                    shutil.copytree(suite, out / "suite")
                cfg = DemoConfig(
                    output_dir=out,
                    max_steps=args.steps,
                    eval_limit=args.eval_limit,
                    val_limit=8,
                    workers=settings[name],
                    progress=False,
                )
                result = run_demo(cfg)
                suite = suite or out / "suite"
                walls[name].append(result.wall_time_s)
                stages[name].append(result.stage_times_s["train_eval"])
                records = _records(result)
                if reference is None:
                    reference = records
                elif records != reference:
                    raise SystemExit(f"round {r}, {name}: records differ from the first round's")
                print(
                    f"round {r} {name:>10} (workers {settings[name]}): wall {result.wall_time_s:6.1f} s, "
                    f"train_eval {result.stage_times_s['train_eval']:6.1f} s, "
                    f"in-domain {[round(100 * x.accuracy['synthetic/geometry'], 1) for x in result.runs]}",
                    flush=True,
                )
    med = {k: statistics.median(v) for k, v in walls.items()}
    med_stage = {k: statistics.median(v) for k, v in stages.items()}
    summary = {
        "steps": args.steps,
        "eval_limit": args.eval_limit,
        "workers": args.workers,
        "repeats": args.repeats,
        "wall_s": walls,
        "train_eval_s": stages,
        "median_wall_s": med,
        "median_train_eval_s": med_stage,
        "ratio_wall_parallel_over_sequential": med["parallel"] / med["sequential"],
        "ratio_train_eval_parallel_over_sequential": med_stage["parallel"] / med_stage["sequential"],
        "records_equal": True,
    }
    print(json.dumps({k: v for k, v in summary.items() if k.startswith(("median", "ratio"))}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
