"""NC-GRPO with a LoRA adapter, at tiny scale: the embedded base model on the synthetic suite.

    python examples/lora.py --output_dir runs/lora-example      # about 10 s on a CPU

The only change from full-weight NC-GRPO is ``peft_config=LoraConfig(...)`` (TRL wraps the model in a
``PeftModel``; the noise still acts on the language model's final-norm states, through the adapter).
``trainer.save_model`` then writes the adapter, not the full weights; ``ncgrpo eval
--model_name_or_path OUTPUT_DIR`` and ``PeftModel.from_pretrained(base, OUTPUT_DIR)`` load it. On your
own model, replace the two ``toy`` lines with your checkpoint and dataset and scale the settings up
(docs/library.md, "LoRA"). Needs peft: ``pip install "ncgrpo[peft]"``.
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, PeftModel

from ncgrpo.data.geometry3k import to_trl_dataset
from ncgrpo.models import load_model_and_processor
from ncgrpo.rewards import math_reward
from ncgrpo.runs.folder import claim_script_folder, finish_script_folder
from ncgrpo.toy.base_model import ensure_base_model
from ncgrpo.toy.suite import build_suite
from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True, help="where the adapter and processor are saved")
    parser.add_argument("--max_steps", type=int, default=4)
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(args.output_dir, "examples/lora.py", kind="train")
    except ValueError as e:
        parser.error(str(e))

    base = ensure_base_model()  # your model: its folder or hub id
    model, processor = load_model_and_processor(base, dtype="float32", device=None, freeze_vision=True)
    train = to_trl_dataset(build_suite(seed=0, sizes={"train": 16, "validation": 1, "test": 1})["train"])

    config = NCGRPOConfig(
        output_dir=args.output_dir,
        rollout_method="latent",
        sigma0=0.5,
        sigma_schedule="constant",  # the paper anneals it (sigmoid); a 4-step run would not
        # the embedded base opens every answer with <think> (p > 0.9999): branch where reasoning starts
        # (docs/embedded-base.md); on your model, measure first with `ncgrpo probe`
        branch_prefix="<think>",
        num_generations=4,  # 2 clean + 2 noisy rollouts per prompt
        per_device_train_batch_size=4,
        max_completion_length=24,
        max_steps=args.max_steps,
        learning_rate=1e-3,  # LoRA takes larger steps than full-weight training
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        seed=0,
    )
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,  # TRL generates in training mode: dropout would perturb the clean rollouts too
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        exclude_modules=r"model\.visual(\..*)?",  # the language model only (Qwen-VL's frozen vision tower)
    )
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=[math_reward],
        args=config,
        train_dataset=train,
        processing_class=processor,
        peft_config=lora,
    )
    trainer.train()
    trainer.save_model(args.output_dir)  # adapter_config.json + adapter_model.safetensors
    processor.save_pretrained(args.output_dir)

    finish_script_folder(lock, global_step=int(trainer.state.global_step))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    last = trainer.nc_history[-1].metrics
    print(f"trained {trainable} of {total} parameters (the adapter) for {trainer.state.global_step} steps")
    print(
        f"noise/rel_perturbation {last['noise/rel_perturbation']:.3f} (sigma0 {config.sigma0}), "
        f"noise/first_token_marginal_tv {last.get('noise/first_token_marginal_tv', float('nan')):.4f}"
    )
    print(f"reward/clean {last['reward/clean']:.3f}  reward/noisy {last['reward/noisy']:.3f}")

    # the saved adapter loads onto a fresh copy of the base model
    fresh, _ = load_model_and_processor(base, dtype="float32", device=None)
    loaded = PeftModel.from_pretrained(fresh, args.output_dir)
    print(f"adapter saved to {args.output_dir}; reloaded: {type(loaded).__name__}")
    return {"trainable": trainable, "total": total, **last}


if __name__ == "__main__":
    main()
