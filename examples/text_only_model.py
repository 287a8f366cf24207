"""NC-GRPO on a text-only model: a causal LM with a tokenizer, no images, no processor.

    python examples/text_only_model.py --output_dir runs/text-only                      # about 20 s on a CPU
    python examples/text_only_model.py --output_dir runs/text-only --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct

Nothing changes for text: the noise acts on the language model's final-norm states at the prefill
(Qwen2, Qwen3 and Llama stacks are supported), the dataset has a ``prompt`` and the columns the reward
reads, and ``processing_class`` is the tokenizer. Without ``--model_name_or_path`` the script builds a
tiny random Qwen2 model from its config and a small tokenizer (no download), saves them to
``OUTPUT_DIR/base`` and loads that folder back as any checkpoint would be loaded. A random model
learns nothing in a few steps; the point is the wiring, and the logged noise metrics show the noise at
work (``noise/rel_perturbation`` ~ sigma, the noise-averaged first-token TV above the 0.002 inert line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from datasets import Dataset

from ncgrpo import NCGRPOConfig, NCGRPOTrainer
from ncgrpo.models import load_model_and_processor
from ncgrpo.rewards import math_reward
from ncgrpo.runs.folder import claim_script_folder, finish_script_folder


def build_tiny_text_model(folder: Path) -> Path:
    """A random Qwen2ForCausalLM (hidden 64, 2 layers) and a byte-level BPE tokenizer with a chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ncgrpo.toy.model import build_tokenizer  # trains a 512-token BPE on a small built-in corpus

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument(
        "--model_name_or_path", help="a text model's hub id or folder (default: build a tiny one)"
    )
    parser.add_argument("--max_steps", type=int, default=3)
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(args.output_dir, "examples/text_only_model.py", kind="demo")
    except ValueError as e:
        parser.error(str(e))
    args.output_dir = lock.folder

    path = args.model_name_or_path or build_tiny_text_model(args.output_dir / "base")
    model, tokenizer = load_model_and_processor(path)  # a text checkpoint: (model, tokenizer)

    questions = [(f"What is {a} times {b}?", str(a * b)) for a in range(2, 6) for b in range(2, 4)]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{q} Put the final answer in \\boxed{{}}."}],
                "answer": a,
            }
            for q, a in questions
        ]
    )
    config = NCGRPOConfig(
        output_dir=str(args.output_dir / "run"),
        rollout_method="latent",
        # the paper's 0.2; a random model's first-token logits are nearly flat: 0.2 leaves them inert, and
        # even 1.0 moves the noise-averaged first token by only ~0.001 (TV), below the 0.002 inert line
        sigma0=0.2 if args.model_name_or_path else 2.0,
        sigma_schedule="constant",  # the paper anneals over 60 rollout batches; a 3-step run would not
        num_generations=4,  # 2 clean + 2 noisy rollouts per prompt
        per_device_train_batch_size=8,  # 8 completions = 2 prompts x G per step on one device
        max_completion_length=32,
        max_steps=args.max_steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available(),
        seed=0,
    )
    trainer = NCGRPOTrainer(
        model=model, reward_funcs=math_reward, args=config, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for h in logs:
        print(
            f"step {h['step']}: rel. perturbation {h['noise/rel_perturbation']:.3f}, reward clean "
            f"{h['reward/clean']:.3f} / noisy {h['reward/noisy']:.3f}, noise-averaged first-token TV "
            f"{h['noise/first_token_marginal_tv']:.4f}"
        )
    finish_script_folder(lock)
    return logs


if __name__ == "__main__":
    main()
