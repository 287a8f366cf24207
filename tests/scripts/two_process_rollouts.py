"""Run a tiny NC-GRPO training and dump every rank's ``nc_history`` as JSON.

Used by tests/test_trainer_distributed.py, once as

    accelerate launch --cpu --num_processes 2 tests/scripts/two_process_rollouts.py OUT --per-device 2

(groups of G=4 span the two processes: rank 0 holds a group's clean half, rank 1 its noisy half)
and once as a single process with ``--per-device 4`` (same global batch). Each rank writes
``OUT/rank{r}.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("tiny_grpo", Path(__file__).parent / "tiny_grpo.py")
tiny = importlib.util.module_from_spec(_spec)
sys.modules["tiny_grpo"] = tiny
_spec.loader.exec_module(tiny)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--per-device", type=int, required=True)
    ap.add_argument("--method", default="spsa")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--target", type=float, default=None, help="target_marginal_tv (None: sigma0's schedule)")
    ap.add_argument("--scope", default="batch", help="target_scope")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tr = tiny.trainer(
        out / "run",
        rollout_method=a.method,
        per_device_train_batch_size=a.per_device,
        num_generations=4,
        max_steps=a.steps,
        sigma_schedule="sigmoid",
        schedule_k_mid=1.0,
        schedule_gamma=2.0,
        spsa_lr=5.0,
        spsa_mu_max=100.0,
        target_marginal_tv=a.target,
        target_scope=a.scope,
    )
    tr.train()
    rank = tr.accelerator.process_index
    dump = {
        "num_processes": tr.accelerator.num_processes,
        "history": [
            {
                "step": r.step,
                "sigma_k": r.sigma_k,
                "rows": r.rows,
                "local_rows": r.local_rows,
                "rel": r.rel,
                "rewards": r.rewards,
                "advantages": r.advantages,
                "mu_norm": r.method_values.get("mu_norm"),
                "metrics": r.metrics,
            }
            for r in tr.nc_history
        ],
        "mu": None if getattr(tr.nc_state, "mu", None) is None else tr.nc_state.mu.tolist(),
        "param_sum": float(sum(p.detach().double().sum() for p in tr.model.parameters())),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(dump))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
