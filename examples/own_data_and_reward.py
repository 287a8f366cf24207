"""NC-GRPO on your own data and your own reward, with the library: a JSON-lines file and a Python function.

    python examples/own_data_and_reward.py --output_dir runs/own-data                # about 30 s on a CPU
    python examples/own_data_and_reward.py --output_dir runs/own-data --data my.jsonl --model_name_or_path MODEL

``--data``: one JSON object per line, ``{"question": "...", "answer": "..."}`` plus, for a
vision-language model, ``"image": "path/to/figure.png"`` (relative to the file). Without ``--data`` the
script writes a small arithmetic file into ``--output_dir`` and trains on it. The reward is any
function TRL accepts: it gets the completions and every dataset column (here ``answer``) as keyword
arguments and returns one float per completion (``None``: does not apply). ncgrpo checks each call.

The model defaults to the embedded tiny base (a Qwen2.5-VL-architecture model that opens its answers
with ``<think>``, hence ``branch_prefix``); on yours, run ``ncgrpo probe`` first (examples/probe_first.py)
and scale the settings up (the paper's are in recipes/base/geo3k_qwen2_5_vl_7b.yaml).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from datasets import Dataset
from PIL import Image

from ncgrpo import NCGRPOConfig, NCGRPOTrainer
from ncgrpo.models import load_model_and_processor
from ncgrpo.rewards import completion_text
from ncgrpo.runs.folder import claim_script_folder, finish_script_folder


def last_integer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last integer in the completion equals the gold answer, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d+", completion_text(completion))  # a completion may be text or a chat
        rewards.append(1.0 if numbers and numbers[-1] == str(gold).strip() else 0.0)
    return rewards


def load_jsonl(path: Path) -> Dataset:
    """Rows of TRL's conversational format: ``prompt`` (+ ``images``) and the ``answer`` the reward reads."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            question, answer = str(item["question"]), str(item["answer"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}:{n}: expected {{'question': ..., 'answer': ...}}: {e!r}") from None
        content = [{"type": "text", "text": f"{question} Put the final answer in \\boxed{{}}."}]
        row = {"prompt": [{"role": "user", "content": content}], "answer": answer}
        if "image" in item:  # one {"type": "image"} part per entry of "images"
            content.insert(0, {"type": "image"})
            row["images"] = [Image.open(path.parent / item["image"]).convert("RGB")]
        rows.append(row)
    if not rows:
        raise SystemExit(f"{path}: no rows")
    if len({"images" in r for r in rows}) > 1:
        raise SystemExit(f"{path}: either every row has an image or none does")
    return Dataset.from_list(rows)


def write_example_data(path: Path, n: int = 16) -> Path:
    with path.open("w") as f:
        for k in range(n):
            a, b = 2 + k % 5, 3 + k // 5
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument(
        "--data", type=Path, help="JSON lines with question and answer (default: a written example)"
    )
    parser.add_argument("--model_name_or_path", help="hub id or folder (default: the embedded tiny base)")
    parser.add_argument("--max_steps", type=int, default=4)
    args = parser.parse_args(argv)
    try:  # a new folder (or this script's own earlier output), locked while the script writes it
        lock = claim_script_folder(args.output_dir, "examples/own_data_and_reward.py", kind="train")
    except ValueError as e:
        parser.error(str(e))
    args.output_dir = lock.folder

    data = args.data or write_example_data(args.output_dir / "example.jsonl")
    dataset = load_jsonl(data)
    model_path = args.model_name_or_path
    if model_path is None:
        from ncgrpo.toy.base_model import ensure_base_model

        model_path = ensure_base_model()
    model, processor = load_model_and_processor(model_path)

    config = NCGRPOConfig(
        output_dir=str(args.output_dir),
        rollout_method="latent",  # NC-GRPO: half of each group branches from a noisy prefill
        sigma0=0.5,
        sigma_schedule="constant",  # the paper anneals (sigmoid over 60 rollout batches); 4 steps would not
        branch_prefix="<think>" if args.model_name_or_path is None else "",  # yours: see `ncgrpo probe`
        num_generations=4,  # G = 4: 2 clean + 2 noisy rollouts per prompt
        per_device_train_batch_size=4,  # 4 completions x GPUs x steps_per_generation: a multiple of G
        max_completion_length=48,
        max_steps=args.max_steps,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available(),
        seed=0,
    )
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=[last_integer_reward],
        args=config,
        train_dataset=dataset,
        processing_class=processor,
    )
    trainer.train()
    trainer.save_model(str(args.output_dir))  # weights and processor, loadable as any checkpoint
    trainer.create_model_card()  # README.md: NC-GRPO, its settings, the base model, the paper
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for h in logs:
        print(
            f"step {h['step']}: reward {h['reward']:.3f} (clean {h['reward/clean']:.3f}, noisy "
            f"{h['reward/noisy']:.3f}), noise-averaged first-token TV {h['noise/first_token_marginal_tv']:.4f}"
        )
    finish_script_folder(lock, global_step=int(trainer.state.global_step))
    return logs


if __name__ == "__main__":
    main()
