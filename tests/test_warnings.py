"""No warning at the defaults: ``NCGRPOConfig`` at TRL's and the recipes' settings, the processor with a
pixel budget, and the cheap forms of ``ncgrpo train`` (tiny recipe), ``demo``, ``eval`` and ``probe``
run with every warning shown (``-W default``). Each warning seen had a cause fixed where it arose, not a
filter: transformers' ``gradient_checkpointing`` FutureWarning (the recipes' portable name is moved to
``activation_checkpointing``), its "min_pixels ... deprecated" FutureWarning (the budget goes into the
image processor's ``size``), and the schedule warning (now said where the config is built, and in the
image method's terms)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "src" / "ncgrpo" / "toy" / "assets" / "base"


def _config(**kw):
    from ncgrpo import NCGRPOConfig

    kw = {"output_dir": "unused", "bf16": False, "num_generations": 4, "per_device_train_batch_size": 4} | kw
    return NCGRPOConfig(**kw)


@pytest.mark.parametrize("value", [None, True, False])
def test_gradient_checkpointing_gives_no_future_warning(value) -> None:
    kw = {} if value is None else {"gradient_checkpointing": value}  # None: TRL's default (on)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = _config(**kw)
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    expected = True if value is None else value
    assert getattr(args, "activation_checkpointing", args.gradient_checkpointing) is expected


def test_gradient_checkpointing_kwargs_give_no_future_warning() -> None:
    """The paper recipes' `gradient_checkpointing_kwargs: {use_reentrant: false}` (the portable name)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = _config(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not [w for w in seen if issubclass(w.category, FutureWarning)], [str(w.message) for w in seen]
    kwargs = getattr(args, "activation_checkpointing_kwargs", args.gradient_checkpointing_kwargs)
    assert kwargs == {"use_reentrant": False}


def test_no_pinned_memory_without_an_accelerator() -> None:
    """torch's DataLoader warns at every epoch when asked to pin memory with no accelerator (CPU runs)."""
    import torch

    assert (
        _config().dataloader_pin_memory is torch.accelerator.is_available()
    )  # TRL's default where it can pin
    assert _config(use_cpu=True).dataloader_pin_memory is False


def test_schedule_warning_names_the_callers_line_and_the_image_methods_noise() -> None:
    with pytest.warns(UserWarning, match="never anneals") as seen:
        _config(max_steps=2, rollout_method="latent")
    (w,) = [w for w in seen if "never anneals" in str(w.message)]
    assert Path(w.filename).resolve() == Path(__file__).resolve(), w.filename  # not <string>:219
    assert "sigma stays near sigma0" in str(w.message)

    with pytest.warns(UserWarning, match="never anneals") as seen:
        _config(max_steps=2, rollout_method="image")
    msg = next(str(w.message) for w in seen if "never anneals" in str(w.message))
    assert "image_noise_step" in msg and "sigma" not in msg.split("never anneals")[1], msg


def test_pixel_budget_sets_the_size_and_gives_no_future_warning() -> None:
    from PIL import Image

    from ncgrpo.models import load_processor

    proc = load_processor(BASE, min_pixels=28 * 28, max_pixels=112 * 112)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = proc.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = proc(text=[text], images=[Image.new("RGB", (400, 400))])
    # the budget is honoured: 112 x 112 pixels = 8 x 8 patches of 14
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    default = load_processor(BASE)(text=[text], images=[Image.new("RGB", (400, 400))])
    assert default["image_grid_thw"].tolist() != [[1, 8, 8]]  # the checkpoint's own budget differs


@pytest.mark.parametrize("method", ["latent", "image"])
def test_a_training_step_warns_nothing(tmp_path, method) -> None:
    """One NCGRPOTrainer step through the library on the embedded base, every warning recorded (numpy's
    DeprecationWarning about tensors turned into arrays on the image method's path included)."""
    from datasets import Dataset
    from PIL import Image

    from ncgrpo import NCGRPOTrainer
    from ncgrpo.models import load_model_and_processor
    from ncgrpo.rewards import math_reward

    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2 + 3? \\boxed{}"}]}]
    data = Dataset.from_list([{"prompt": chat, "images": [Image.new("RGB", (56, 56))], "answer": "5"}] * 2)
    model, processor = load_model_and_processor(BASE, device=None)
    args = _config(
        output_dir=str(tmp_path),
        rollout_method=method,
        max_steps=1,
        schedule_k_mid=1,
        max_completion_length=4,
        branch_prefix="<think>",
        save_strategy="no",
        report_to="none",
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = NCGRPOTrainer(
            model=model, reward_funcs=math_reward, args=args, train_dataset=data, processing_class=processor
        )
        trainer.train()
    mine = [w for w in seen if not issubclass(w.category, ResourceWarning)]
    assert not mine, [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in mine]


def test_the_command_line_says_ncgrpos_warnings_in_its_own_voice(tmp_path) -> None:
    """A warning of ncgrpo's reads `ncgrpo train: warning: ...`, not `/path/bin/ncgrpo:6: UserWarning: ...`."""
    args = ["train", "--config", str(ROOT / "recipes" / "tiny_cpu_latent.yaml"), "--schedule_k_mid", "40"]
    args += ["--model_name_or_path", str(BASE)]
    out = _run(tmp_path, *args, "--output_dir", "k", "--dry-run")
    assert "ncgrpo train: warning: schedule_k_mid=40.0 is after the last step" in out, out[-2000:]
    assert "UserWarning" not in out, out[-2000:]


_WARNING = re.compile(r"\b\w*Warning\b: |warnings\.warn|resource_tracker")


def _run(tmp_path: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONWARNINGS="default", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-m", "ncgrpo", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


def _no_warnings(out: str) -> None:
    lines = [line for line in out.splitlines() if _WARNING.search(line)]
    assert not lines, "\n".join(lines)


@pytest.mark.slow
def test_commands_at_their_defaults_warn_nothing(tmp_path) -> None:
    """train with the tiny recipe and two paper recipes' --smoke forms, a short demo, eval of its suite, probe:
    no warning of any kind."""
    _no_warnings(
        _run(
            tmp_path,
            "train",
            "--config",
            str(ROOT / "recipes" / "tiny_cpu_latent.yaml"),
            "--model_name_or_path",
            str(BASE),
            "--output_dir",
            "train",
        )
    )
    demo = ["--max_steps", "2", "--train_size", "16", "--validation_size", "4", "--test_size", "8"]
    demo += ["--eval_limit", "8", "--val_limit", "4", "--val_every", "1", "--workers", "1", "--no_progress"]
    _no_warnings(_run(tmp_path, "demo", "--output_dir", "demo", *demo))
    _no_warnings(
        _run(
            tmp_path,
            "eval",
            "--model_name_or_path",
            str(BASE),
            "--benchmarks",
            "synthetic",
            "--data",
            f"synthetic={tmp_path / 'demo' / 'suite'}",
            "--limit",
            "4",
            "--output_dir",
            "eval",
            "--no_progress",
        )
    )
    for recipe in ("qwen2_5_vl_7b_latent_sigma0.2", "qwen2_5_vl_7b_image"):  # a paper recipe's smoke form
        config = str(ROOT / "recipes" / f"{recipe}.yaml")
        _no_warnings(
            _run(tmp_path, "train", "--config", config, "--smoke", "--output_dir", f"smoke-{recipe}")
        )
    _no_warnings(
        _run(tmp_path, "probe", "--prompts", "4", "--rollouts", "2", "--sigma0", "0", "0.2", "--no_progress")
    )
