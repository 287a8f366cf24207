"""torchrun --nproc_per_node 2 tp_group_rows.py OUT_DIR: each rank plans its own rows (global row
indices, as NCGRPOTrainer does), then gathers the TP group's rows the way TRL gathers its prompts
(ncgrpo.trainer.vllm._tp_group_rows over a group built like TRL's tp_group). Writes OUT_DIR/rank{r}.json."""

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from ncgrpo.core.plan import plan_rows
from ncgrpo.methods import get_method
from ncgrpo.trainer.vllm import _tp_group_rows


def _row(r) -> list | None:
    return (
        None if r is None else [r.sigma, None if r.key is None else list(dataclasses.astuple(r.key)), r.sign]
    )


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group, _ = dist.new_subgroups_by_enumeration([list(range(world))])  # as TRL builds it (TP = world)
    L = 4  # local rows: one prompt x G=4 per rank
    plans = plan_rows(
        range(rank * L, (rank + 1) * L),
        [10 + rank] * L,
        num_generations=4,
        method=get_method("latent"),
        seed=3,
        step=2,
    )
    rows = [get_method("latent").row_noise(p, 0.5) for p in plans]
    scales = [float(rank) + i / 10 for i in range(L)]
    gen = SimpleNamespace(tensor_parallel_size=world, tp_group=tp_group)
    all_rows, all_scales = _tp_group_rows(gen, rows, scales)
    prompts = [[rank, i] for i in range(L)]  # TRL's own gather of the prompts, for the order
    gathered: list = [None] * world
    dist.all_gather_object(gathered, prompts, group=tp_group)
    none_rows, none_scales = _tp_group_rows(gen, rows, None)
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "local": [_row(r) for r in rows],
                "rows": [_row(r) for r in all_rows],
                "scales": all_scales,
                "prompts": [p for part in gathered for p in part],
                "none_scales": none_scales,
                "same_without_scales": [repr(r) for r in none_rows] == [repr(r) for r in all_rows],
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
