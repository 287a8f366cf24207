"""A run trained through ``NCGRPOTrainer`` (the library, no ``ncgrpo train``) is first-class (issue 44):
its folder holds ``run.json`` (name, method, seed, identity) and ``metrics.jsonl`` as ``ncgrpo train``'s
does, so ``ncgrpo plot dynamics``, ``ncgrpo eval`` and ``ncgrpo compare`` read it with its method and
seed.

Before: ``plot dynamics`` refused the folder ("has no metrics.jsonl") and ``eval`` printed "training run
None (method None, seed None)".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset
from PIL import Image

from ncgrpo import NCGRPOConfig, NCGRPOTrainer, cli
from ncgrpo.models import load_model_and_processor
from ncgrpo.rewards import math_reward

BASE = Path(__file__).resolve().parents[1] / "src" / "ncgrpo" / "toy" / "assets" / "base"


def _dataset(n: int = 2) -> Dataset:
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "2 + 3 = ? \\boxed{}"}]}]
    return Dataset.from_list([{"prompt": chat, "images": [Image.new("RGB", (56, 56))], "answer": "5"}] * n)


def _trainer(out: Path, **overrides) -> NCGRPOTrainer:
    model, processor = load_model_and_processor(BASE, device=None)
    settings = dict(
        output_dir=str(out),
        run_name="lib-latent",
        rollout_method="latent",
        seed=5,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=1,
        schedule_k_mid=1,
        logging_steps=1,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
    )
    args = NCGRPOConfig(**{**settings, **overrides})
    return NCGRPOTrainer(
        model=model, reward_funcs=math_reward, args=args, train_dataset=_dataset(), processing_class=processor
    )


def _metric_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def library_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lib") / "run"
    trainer = _trainer(out)
    trainer.train()
    trainer.save_model()  # as TRL's scripts do: the weights beside run.json
    return out


def test_library_run_writes_run_json_and_metrics(library_run) -> None:
    info = json.loads((library_run / "run.json").read_text())
    assert info["kind"] == "train" and info["finished"] is True and info["global_step"] == 1
    assert (info["name"], info["method"], info["seed"]) == ("lib-latent", "latent", 5)
    assert info["model"] == str(BASE) and info["trained_with"] == "NCGRPOTrainer"
    assert info["provenance"]["ncgrpo_version"] and "versions" in info["provenance"]  # what made it
    ident = info["identity"]
    assert ident["rollout_method"] == "latent" and ident["seed"] == 5 and ident["sigma0"] == 0.2
    assert ident["model_name_or_path"] == str(BASE) and ident["dtype"] == "float32"
    assert "output_dir" not in ident and "logging_steps" not in ident  # what may change on resume
    rows = _metric_rows(library_run)
    trained = [r for r in rows if "reward" in r]
    assert [r["step"] for r in trained] == [1] and "noise/sigma_k" in trained[0]


def test_plot_eval_and_compare_read_the_library_run(library_run, tmp_path, monkeypatch, capsys) -> None:
    from eval.test_own_benchmark import write_own_benchmark

    monkeypatch.chdir(tmp_path)
    assert cli.main(["plot", "dynamics", "--train_dirs", str(library_run), "--output_dir", "figs"]) == 0
    assert (tmp_path / "figs" / "dynamics.png").stat().st_size > 0

    data = write_own_benchmark(tmp_path / "data")
    common = ["--max_new_tokens", "3", "--device", "cpu", "--no_progress", "--data", f"mine={data}"]
    assert cli.main(["eval", "--model_name_or_path", str(library_run), *common]) == 0
    err = capsys.readouterr().err
    assert "training run 'lib-latent' (method latent, seed 5)" in err
    ev = tmp_path / "evals" / "lib-latent-latent-seed5"
    info = json.loads((ev / "run.json").read_text())
    assert (info["name"], info["method"], info["seed"]) == ("lib-latent", "latent", 5)

    base = [
        "eval",
        "--model_name_or_path",
        str(BASE),
        *common,
        "--name",
        "base",
        "--output_dir",
        "evals/base",
    ]
    assert cli.main(base) == 0
    capsys.readouterr()
    assert cli.main(["compare", "--runs", "evals/base", str(ev), "--baseline", "base"]) == 0
    assert "lib-latent" in capsys.readouterr().out


def test_a_fresh_library_run_into_a_finished_run_is_refused(library_run) -> None:
    before = (library_run / "metrics.jsonl").read_bytes()
    trainer = _trainer(library_run)
    with pytest.raises(ValueError, match="holds a finished run \\('lib-latent', 1 steps"):
        trainer.train()
    assert (library_run / "metrics.jsonl").read_bytes() == before  # nothing cut


def test_a_resumed_library_run_with_changed_settings_warns_and_records_them(tmp_path) -> None:
    out = tmp_path / "run"
    first = _trainer(out, save_strategy="steps", save_steps=1)
    first.train()
    resumed = _trainer(out, save_strategy="steps", save_steps=1, max_steps=2, learning_rate=2e-6)
    with pytest.warns(UserWarning, match="learning_rate: 1e-06 -> 2e-06"):
        resumed.train(resume_from_checkpoint=True)
    info = json.loads((out / "run.json").read_text())
    assert info["global_step"] == 2 and info["finished"] is True
    assert any(c.startswith("max_steps: 1 -> 2") for c in info["forced_changes"])
    assert [r["step"] for r in _metric_rows(out) if "reward" in r] == [1, 2]  # each step once


def test_ncgrpo_train_writes_run_json_and_each_metrics_line_once(tmp_path) -> None:
    """ncgrpo train's driver records the folder itself (the recipe, the command's identity): the trainer's
    own record stays off and its one metrics writer logs each step once."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu_latent.yaml"
    out = tmp_path / "run"
    argv = ["train", "--config", str(recipe), "--model_name_or_path", str(BASE), "--output_dir", str(out)]
    assert cli.main(argv + ["--max_steps", "2", "--schedule_k_mid", "1", "--logging_steps", "1"]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["recipe"] == str(recipe) and "trained_with" not in info and info["finished"] is True
    assert [r["step"] for r in _metric_rows(out) if "reward" in r] == [1, 2]
