"""examples/: every script is listed in examples/README.md, documents its command, and runs as written at
tiny scale with ``--output_dir`` (-m slow: about 3 minutes together on a CPU; CI runs them), with checks of
what each one is for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_examples_are_listed_and_documented() -> None:
    readme = (ROOT / "examples" / "README.md").read_text()
    assert {"own_data_and_reward.py", "text_only_model.py", "evaluate_and_compare.py", "probe_first.py"} <= {
        p.name for p in EXAMPLES
    }
    for script in EXAMPLES:
        text = script.read_text()
        compile(text, str(script), "exec")
        assert f"({script.name})" in readme, f"examples/README.md does not list {script.name}"
        assert re.search(rf"python examples/{re.escape(script.name)} --output_dir \S+", text), (
            f"{script.name}: its docstring should show how to run it (python examples/{script.name} --output_dir ...)"
        )


def _run(script: str, out: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--output_dir", str(out), *args],
        cwd=out.parent,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc.stdout


def _steps(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_own_data_and_reward(tmp_path) -> None:
    out = tmp_path / "own"
    stdout = _run("own_data_and_reward.py", out)
    assert len(_steps(stdout)) == 4, stdout[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "example.jsonl").is_file()
    assert "NC-GRPO" in (out / "README.md").read_text()  # the model card

    # a user's file with a bad row is named, with its line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 1?", "answer": "2"}\n{"question": "no answer"}\n')
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "own_data_and_reward.py"),
            "--output_dir",
            str(tmp_path / "b"),
        ]
        + ["--data", str(bad)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and f"{bad}:2:" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_text_only_model(tmp_path) -> None:
    out = tmp_path / "text"
    stdout = _run("text_only_model.py", out)
    config = json.loads((out / "base" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and not (out / "base" / "processor_config.json").exists()
    steps = _steps(stdout)
    assert len(steps) == 3, stdout[-2000:]
    for line in steps:  # the noise acts: ||h~ - h|| / ||h|| near sigma0 = 2, marginal TV above the inert line
        rel = float(re.search(r"rel. perturbation ([\d.]+)", line).group(1))
        tv = float(re.search(r"first-token TV ([\d.]+)", line).group(1))
        assert 1.6 < rel < 2.4 and tv > 0.002, line


@pytest.mark.slow
def test_evaluate_and_compare(tmp_path) -> None:
    out = tmp_path / "compare"
    _run("evaluate_and_compare.py", out, "--questions", "4")
    for method in ("vanilla", "latent"):
        records = (out / "evals" / method / "records.jsonl").read_text().splitlines()
        assert len(records) == 6 * 4  # six families x 4 test questions, one record each
    table = (out / "tables" / "comparison.md").read_text()
    assert "latent" in table and "vanilla" in table


@pytest.mark.slow
def test_text_cli_vanilla_vs_ncgrpo(tmp_path) -> None:
    """Own JSONL + own reward through ncgrpo train and eval, both methods, two seeds, the seed-level test."""
    out = tmp_path / "text-cli"
    stdout = _run(
        "text_cli_vanilla_vs_ncgrpo.py", out, "--seeds", "2", "--max_steps", "2", "--test_prompts", "8"
    )
    results = json.loads((out / "results.json").read_text())
    assert [len(results["runs"][m]) for m in ("vanilla", "latent")] == [2, 2]
    assert results["nc_minus_vanilla"]["n_seeds"] == 2 and "NC-GRPO - vanilla over 2 seeds" in stdout
    for method in ("vanilla", "latent"):
        run = json.loads((out / "runs" / f"{method}-seed1" / "run.json").read_text())
        assert run["finished"] and run["method"] == method and run["identity"]["dataset_sha256"]
        metrics = (out / "runs" / f"{method}-seed1" / "metrics.jsonl").read_text()
        assert "rewards/side/mean" in metrics  # the user's reward, by import path
        assert len((out / "evals" / f"{method}-seed1" / "records.jsonl").read_text().splitlines()) == 8


@pytest.mark.slow
def test_probe_first(tmp_path) -> None:
    out = tmp_path / "probe"
    _run("probe_first.py", out, "--prompts", "4")
    suggested = json.loads((out / "suggested.json").read_text())
    # the embedded base opens with <think> (p > 0.9999): without the prefix the noise is inert, with it it acts
    assert suggested["branch_prefix"] == "<think>" and suggested["marginal_tv"] > 0.002, suggested
    none = json.loads((out / "probe-none.json").read_text())
    assert all(r["verdict"].startswith("inert") for r in none["rows"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        p.name
        for p in EXAMPLES
        if p.name
        not in {
            "own_data_and_reward.py",
            "text_only_model.py",
            "evaluate_and_compare.py",
            "probe_first.py",
            "text_cli_vanilla_vs_ncgrpo.py",
        }
    ],
)
def test_other_examples_run(tmp_path, script) -> None:
    """Examples added later (lora.py, ...) run as written too."""
    _run(script, tmp_path / "out")
