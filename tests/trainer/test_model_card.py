"""The model card NCGRPOTrainer writes at a checkpoint names NC-GRPO (the method as run), the base model
(a local folder too: TRL wrote "a fine-tuned version of [None]") and the paper, beside GRPO and TRL."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Dataset
from PIL import Image

from ncgrpo import NCGRPOConfig, NCGRPOTrainer
from ncgrpo.models import load_model_and_processor
from ncgrpo.rewards import math_reward

BASE = Path(__file__).resolve().parents[2] / "src" / "ncgrpo" / "toy" / "assets" / "base"


def _dataset(n: int = 2) -> Dataset:
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2 + 3 = ? \\boxed{}"}]}]
    return Dataset.from_list([{"prompt": chat, "images": [Image.new("RGB", (56, 56))], "answer": "5"}] * n)


@pytest.mark.parametrize("method", ["latent", "vanilla"])
def test_checkpoint_card_names_the_method_the_base_and_the_paper(tmp_path, method) -> None:
    model, processor = load_model_and_processor(BASE, device=None)
    args = NCGRPOConfig(
        output_dir=str(tmp_path / "run"),
        rollout_method=method,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=1,
        schedule_k_mid=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
    )
    trainer = NCGRPOTrainer(
        model=model, reward_funcs=math_reward, args=args, train_dataset=_dataset(), processing_class=processor
    )
    trainer.train()
    card = (tmp_path / "run" / "README.md").read_text()  # written by TRL's _save_checkpoint
    assert "[None]" not in card
    assert f"the local checkpoint `{BASE}`" in card
    assert "Perturb the Thought, Not the Pixels" in card and "@inproceedings{jerge2027perturb" in card
    assert "DeepSeekMath" in card and "vonwerra2020trl" in card  # GRPO and TRL still cited
    if method == "latent":
        assert "NC-GRPO (Noise-Contrastive GRPO; G = 4: 2 clean + 2 noisy" in card and "sigma0 0.2" in card
    else:
        assert "vanilla GRPO" in card and "sigma0" not in card


def test_hub_base_goes_to_the_metadata(tmp_path) -> None:
    from ncgrpo.trainer.model_card import model_card_text

    class Cfg:
        _name_or_path = "Qwen/Qwen2.5-VL-7B-Instruct"

    class T:
        args = NCGRPOConfig(output_dir=str(tmp_path / "x"), bf16=False, num_generations=4)
        model = type("M", (), {"config": Cfg()})()
        _tag_names = ["trl", "grpo"]

    card = model_card_text(T(), dataset_name="hiyouga/geometry3k")
    assert "base_model: Qwen/Qwen2.5-VL-7B-Instruct" in card
    assert "[Qwen/Qwen2.5-VL-7B-Instruct](https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct)" in card
    assert "on the `hiyouga/geometry3k` dataset" in card


def test_ncgrpo_train_leaves_the_card_in_the_run_folder(tmp_path) -> None:
    """The run driver writes the card next to the final model (TRL writes it only at checkpoints)."""
    from ncgrpo.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu_latent.yaml"
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--model_name_or_path", str(BASE), "--output_dir", str(out)]
    assert main(argv + ["--max_steps", "1", "--schedule_k_mid", "1"]) == 0
    card = (out / "README.md").read_text()
    assert "NC-GRPO (Noise-Contrastive GRPO" in card and f"`{BASE}`" in card and "jerge2027perturb" in card
    # the data as ncgrpo train recorded it (run.json's identity), and how to load the full weights
    assert "- Data: `synthetic`, split `train`" in card and "training prompts)" in card
    assert f'Qwen2_5_VLForConditionalGeneration.from_pretrained("{out}")' in card


def test_a_lora_target_schedule_card_says_what_made_it_and_how_to_load_it(tmp_path) -> None:
    """Issue 44: the card of a target-schedule LoRA run named only "sigma0 0.5, schedule constant" and
    called the adapter-only folder usable "as any checkpoint of its base architecture"."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    model, processor = load_model_and_processor(BASE, device=None, freeze_vision=True)
    out = tmp_path / "run"
    args = NCGRPOConfig(
        output_dir=str(out),
        rollout_method="latent",
        sigma0=0.5,
        sigma_schedule="constant",
        target_marginal_tv=0.05,
        marginal_tv_draws=256,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=1,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
    )
    lora = LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        exclude_modules=r"model\.visual(\..*)?",
    )  # fmt: skip
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=math_reward,
        args=args,
        train_dataset=_dataset(3),
        processing_class=processor,
        peft_config=lora,
    )
    trainer.train()
    trainer.save_model()
    trainer.create_model_card()
    card = (out / "README.md").read_text()
    assert "target_marginal_tv 0.05" in card and "schedule constant" in card
    assert "sigma0 0.5 the solver's first guess" in card and "noise site `final_norm`" in card
    assert "- Rewards: `math_reward` (weight 1)" in card
    assert "- Data: 3 training prompts" in card
    assert "library_name: peft" in card and "- Weights: LoRA adapter (r 4, lora_alpha 8)" in card
    assert "**LoRA adapter only**" in card and "target modules ['q_proj', 'v_proj']" in card
    assert f'base = Qwen2_5_VLForConditionalGeneration.from_pretrained("{BASE}")' in card
    assert f'PeftModel.from_pretrained(base, "{out}")' in card
    assert "as any checkpoint of its base architecture" not in card
    from ncgrpo import __version__

    assert f"- ncgrpo {__version__}" in card and f"- ncgrpo: {__version__}" in card
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").is_file()  # what it says
