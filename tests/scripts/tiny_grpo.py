"""Shared builders for the NC-GRPO trainer tests: a tiny Qwen2.5-VL, a few image prompts, a reward.

Imported by tests/test_trainer.py, tests/test_resume.py and tests/scripts/two_process_rollouts.py
(which ``accelerate launch`` runs on two CPU processes).
"""

from __future__ import annotations

import zlib
from typing import Any

import datasets
import numpy as np
from PIL import Image

from ncgrpo.toy.model import build_processor, build_tokenizer, tiny_qwen2_5_vl
from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer

_CACHE: dict[str, Any] = {}


def processor():
    if "proc" not in _CACHE:
        _CACHE["proc"] = build_processor(build_tokenizer())
    return _CACHE["proc"]


def model(seed: int = 0):
    return tiny_qwen2_5_vl(processor=processor(), seed=seed)


def dataset(n: int = 8, *, question_id: bool = True) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        img = Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))
        row = {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": f"What is {i} + 1?"}],
                }
            ],
            "images": [img],
            "answer": str(i + 1),
        }
        if question_id:
            row["question_id"] = f"q{i}"
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def hash_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward with spread: crc32 of the completion text mod 3 (0, 1 or 2)."""
    return [float(zlib.crc32(str(c).encode()) % 3) for c in completions]


def config_kwargs(out_dir, **overrides) -> dict[str, Any]:
    """Keyword arguments of a tiny CPU run (NC-GRPO fields included)."""
    kw: dict[str, Any] = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL defaults to bf16 autocast, ~13x slower on a CPU without bf16 units
        seed=0,
        save_strategy="no",
        sigma0=1.0,
        sigma_schedule="constant",
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return kw


def config(out_dir, **overrides) -> NCGRPOConfig:
    return NCGRPOConfig(**config_kwargs(out_dir, **overrides))


def grpo_config(out_dir, **overrides):
    """The same run as a plain ``trl.GRPOConfig`` (NC-GRPO fields dropped)."""
    from trl import GRPOConfig

    nc = {f for f in NCGRPOConfig.__dataclass_fields__} - set(GRPOConfig.__dataclass_fields__)
    return GRPOConfig(**{k: v for k, v in config_kwargs(out_dir, **overrides).items() if k not in nc})


def trainer(
    out_dir,
    *,
    seed: int = 0,
    n_prompts: int = 8,
    question_id: bool = True,
    trainer_cls=NCGRPOTrainer,
    args=None,
    **overrides,
):
    args = args if args is not None else config(out_dir, **overrides)
    return trainer_cls(
        model=model(seed),
        reward_funcs=[hash_reward],
        args=args,
        train_dataset=dataset(n_prompts, question_id=question_id),
        processing_class=processor(),
    )
