"""``ncgrpo train --config RECIPE --smoke``: any recipe shrunk to a CPU minute on the embedded base and
the synthetic suite, its method and structure kept (issue 32, item 5).

Every runnable recipe's smoke form passes ``--dry-run`` (every check the run makes before the model
loads); the latent recipe's smoke form trains here and learns something checkable: reward above 0 and
the noise live (noise-averaged first-token TV above the inert line). The other recipes' full smoke runs
are ``-m slow`` (about 10-30 s each on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ncgrpo.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
RUN_RECIPES = sorted(RECIPES.glob("*.yaml"))
PAPER_RECIPES = [p for p in RUN_RECIPES if not p.name.startswith("tiny")]
LATENT = RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml"
#: methods whose noise acts on the first-token distribution and whose marginal TV is logged
MARGINAL_METHODS = {"latent", "antithetic", "spsa", "first_token_marginal"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic suite in Geometry3K's layout, generated once (what --smoke generates per run)."""
    from ncgrpo.toy.suite import build_suite, export_geo3k

    folder = tmp_path_factory.mktemp("suite")
    export_geo3k(build_suite(seed=1), folder)
    return folder


def _parse(path: Path):
    from ncgrpo.commands.parser import ConfigParser
    from ncgrpo.commands.train_settings import train_dataclasses

    return ConfigParser(train_dataclasses).parse_args(["--config", str(path)]).parsed_config


def _smoke_argv(recipe: Path, out: Path, suite: Path) -> list[str]:
    """``ncgrpo train --config RECIPE --smoke`` into ``out`` on the shared synthetic suite."""
    return [
        "train",
        "--config",
        str(recipe),
        "--smoke",
        "--output_dir",
        str(out),
        "--dataset_path",
        str(suite),
    ]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", RUN_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_smoke_form_passes_the_dry_run(
    recipe: Path, suite: Path, tmp_path: Path, capsys
) -> None:
    """The smoke form keeps the method, its settings, G and the updates per rollout batch, and shrinks
    the rest; it passes every check the real run makes before the model loads."""
    from ncgrpo.toy.base_model import ensure_base_model

    out = tmp_path / "run"
    argv = _smoke_argv(recipe, out, suite)
    assert main([*argv, "--dry-run"]) == 0, capsys.readouterr().err
    assert "--smoke:" in capsys.readouterr().err
    full, smoke = _parse(recipe), _parse(out / "config.yaml")
    for key in (
        "rollout_method",
        "sigma0",
        "num_generations",
        "reward_funcs",
        "learning_rate",
        "beta",
        "seed",
    ):
        assert smoke.get(key) == full.get(key), key
    assert smoke.get("model_name_or_path") == str(ensure_base_model())
    assert smoke.get("dataset_name") == "synthetic" and smoke.get("use_vllm") is False
    assert smoke.get("bf16") is False and smoke.get("dtype") == "float32"  # dtype follows bf16
    assert smoke.get("branch_prefix") == "<think>" and smoke.get("max_completion_length") == 48
    assert smoke.get("run_name") == f"{full.get('run_name')}-smoke"
    g, per_device = full.get("num_generations"), smoke.get("per_device_train_batch_size")
    assert per_device == g and smoke.get("gradient_accumulation_steps") == 1
    # the updates per rollout batch are the recipe's (steps_per_generation follows the accumulation)
    ratio = (full.get("steps_per_generation") or full.get("gradient_accumulation_steps")) // full.get(
        "gradient_accumulation_steps"
    )
    assert (smoke.get("steps_per_generation") or 1) == ratio
    assert smoke.get("max_steps") == 2 * ratio  # two rollout batches
    site = str(smoke.get("noise_site"))
    assert site == "final_norm" or max(int(s) for s in site.split(",")) < 3  # the embedded base's 3 layers


def test_smoke_yields_to_flags_given_on_the_command_line(suite: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = _smoke_argv(LATENT, out, suite)
    assert (
        main([*argv, "--max_completion_length", "32", "--gradient_accumulation_steps", "2", "--dry-run"]) == 0
    )
    smoke = _parse(out / "config.yaml")
    assert smoke.get("max_completion_length") == 32
    # the recipe's 4 updates per rollout batch at the accumulation given: 4 x 2
    assert smoke.get("gradient_accumulation_steps") == 2 and smoke.get("steps_per_generation") == 8
    # still two rollout batches of 4 updates each, and eq. (3)'s k_mid scaled with them (it was 192
    # steps, 48 rollout batches, when max_steps took the ratio 192 / 2 before steps_per_generation followed)
    full = _parse(LATENT)
    assert smoke.get("max_steps") == 8
    assert smoke.get("schedule_k_mid") == round(full.get("schedule_k_mid") * 8 / full.get("max_steps"), 4)
    assert yaml.safe_load((out / "config.yaml").read_text())["output_dir"] == str(out)


def test_smoke_scales_k_mid_to_the_max_steps_given(suite: Path, tmp_path: Path, capsys) -> None:
    """--smoke --max_steps 4: eq. (3)'s k_mid follows the run's 4 steps, not the smoke default's 8 over
    the 4 given (which set it to 80, after the last step: the schedule never annealed, with a warning)."""
    out = tmp_path / "run"
    argv = _smoke_argv(LATENT, out, suite)
    assert main([*argv, "--max_steps", "4", "--dry-run"]) == 0
    assert "never anneals" not in capsys.readouterr().err
    full, smoke = _parse(LATENT), _parse(out / "config.yaml")
    assert smoke.get("max_steps") == 4
    assert smoke.get("schedule_k_mid") == round(full.get("schedule_k_mid") * 4 / full.get("max_steps"), 4)


def test_the_latent_recipe_smoke_run_learns_something_checkable(tmp_path: Path, capsys) -> None:
    """The paper's main recipe, as a user tries it: reward above 0, gradients, the noise not inert
    (the tiny recipe of 894aedc logged reward, loss and grad norm 0 and a marginal TV of ~4e-10)."""
    from ncgrpo.trainer.inert import INERT_MARGINAL_THRESHOLD

    out = tmp_path / "run"
    assert main(["train", "--config", str(LATENT), "--smoke", "--output_dir", str(out)]) == 0, (
        capsys.readouterr().err
    )
    rows = _rows(out)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))  # 2 rollout batches x 4 updates
    generations = [r for r in rows if "reward" in r]
    assert len(generations) == 2 and max(r["reward"] for r in generations) > 0
    assert max(r["grad_norm"] for r in steps) > 0
    assert max(r["noise/first_token_marginal_tv"] for r in generations) > INERT_MARGINAL_THRESHOLD
    assert all(r["completions/clipped_ratio"] < 1 for r in generations)
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 8 and run["method"] == "latent"
    assert (out / "synthetic-data" / "data").is_dir()  # the generated suite, moved in once the model loaded


@pytest.mark.slow
@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=lambda p: p.stem)
def test_every_paper_recipe_smoke_run_trains(recipe: Path, suite: Path, tmp_path: Path, capsys) -> None:
    from ncgrpo.trainer.inert import INERT_MARGINAL_THRESHOLD, INERT_THRESHOLD

    out = tmp_path / "run"
    argv = _smoke_argv(recipe, out, suite)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(argv) == 0, capsys.readouterr().err
    # issue 33: a recipe's smoke form, at its defaults, says nothing the user has to read past
    said = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, DeprecationWarning)
    ]
    assert not said, said
    rows = _rows(out)
    generations = [r for r in rows if "reward" in r]
    assert generations and max(r["reward"] for r in generations) > 0
    assert json.loads((out / "run.json").read_text())["finished"]
    resolved = _parse(out / "config.yaml")
    if resolved.get("rollout_method") in MARGINAL_METHODS:
        # the marginal TV is measured at the final-norm site; a layer site (the propagating variant, whose
        # noise reaches K/V) logs the per-draw TV, held to its own inert line (ncgrpo.trainer.inert)
        final_norm = str(resolved.get("noise_site")) == "final_norm"
        key = "noise/first_token_marginal_tv" if final_norm else "noise/first_token_tv"
        tv = [r[key] for r in generations if key in r]
        assert tv and max(tv) > (INERT_MARGINAL_THRESHOLD if final_norm else INERT_THRESHOLD), (key, tv)


def test_smoke_with_eval_during_training_passes_the_dry_run(suite: Path, tmp_path: Path, capsys) -> None:
    """--smoke keeps G = 12; TRL's default eval batch (8) does not divide it, so turning eval on (what a
    validation curve in `ncgrpo plot dynamics` needs) was refused: the smoke form sets the eval batch to G."""
    out = tmp_path / "run"
    argv = _smoke_argv(LATENT, out, suite)
    argv += [
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "4",
        "--eval_dataset_splits",
        "validation",
        "--dry-run",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    assert _parse(out / "config.yaml").get("per_device_eval_batch_size") == 12


# ------------------------------------------------------------------------------ text recipes (issue 44)
TEXT_RECIPES = sorted((RECIPES / "text").glob("*.yaml"))
TEXT_LATENT = RECIPES / "text" / "qwen2_5_math_1_5b_gsm8k_latent_sigma0.2.yaml"


def test_the_text_recipes_are_there() -> None:
    stems = {p.stem for p in TEXT_RECIPES}
    for model in ("qwen2_5_math_1_5b", "qwen2_5_math_7b"):
        for data in ("gsm8k", "math"):
            for method in ("vanilla", "latent_sigma0.2"):
                assert f"{model}_{data}_{method}" in stems
    assert {"qwen3_1_7b_thinking_math_vanilla", "qwen3_1_7b_thinking_math_latent_sigma0.2"} <= stems
    for path in TEXT_RECIPES:
        full = _parse(path)
        assert full.get("num_generations") == 8 and full.get("temperature") == 1.0, path.name
        assert full.get("max_completion_length") >= 3072 and full.get("dataset_name").endswith(".jsonl")
        if "qwen3" in path.stem:
            assert full.get("branch_prefix") == "<think>"


@pytest.mark.parametrize("recipe", TEXT_RECIPES, ids=lambda p: p.stem)
def test_every_text_recipe_smoke_form_passes_the_dry_run(recipe: Path, tmp_path: Path, capsys) -> None:
    """A text recipe's smoke form is text on both sides: the embedded base's language model as a text-only
    Qwen2 and addition problems written in the recipe's own columns (prompt_column / answer_column kept)."""
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), "--smoke", "--output_dir", str(out), "--dry-run"]) == 0, (
        capsys.readouterr().err
    )
    assert "language model (text-only)" in capsys.readouterr().err
    full, smoke = _parse(recipe), _parse(out / "config.yaml")
    for key in ("rollout_method", "sigma0", "num_generations", "reward_funcs", "prompt_column", "answer_column",
                "system_prompt", "math_prompt", "learning_rate", "beta", "seed"):  # fmt: skip
        assert smoke.get(key) == full.get(key), key
    config = json.loads((Path(smoke.get("model_name_or_path")) / "config.json").read_text())
    assert config["model_type"] == "qwen2" and "vision_config" not in config
    first = json.loads(Path(smoke.get("dataset_name")).read_text().splitlines()[0])
    assert {full.get("prompt_column"), full.get("answer_column") or "answer"} <= set(first)
    assert smoke.get("use_vllm") is False and smoke.get("max_steps") == 2


def test_the_text_latent_recipe_smoke_run_trains(tmp_path: Path, capsys) -> None:
    """The 1.5B GSM8K NC-GRPO recipe's smoke form trains from the command line, text-only: its two
    rollout batches are logged with their reward and a live noise (marginal TV above the inert line)."""
    from ncgrpo.trainer.inert import INERT_MARGINAL_THRESHOLD

    out = tmp_path / "run"
    assert main(["train", "--config", str(TEXT_LATENT), "--smoke", "--output_dir", str(out)]) == 0, (
        capsys.readouterr().err
    )
    generations = [r for r in _rows(out) if "reward" in r]
    assert len(generations) == 2 and "rewards/accuracy_reward/mean" in generations[0]
    assert generations[0]["noise/first_token_marginal_tv"] > INERT_MARGINAL_THRESHOLD
    run = json.loads((out / "run.json").read_text())
    assert run["finished"] and run["global_step"] == 2 and run["method"] == "latent"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TEXT_RECIPES, ids=lambda p: p.stem)
def test_every_text_recipe_smoke_run_trains(recipe: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert main(["train", "--config", str(recipe), "--smoke", "--output_dir", str(out)]) == 0, (
        capsys.readouterr().err
    )
    generations = [r for r in _rows(out) if "reward" in r]
    assert len(generations) == 2 and all(r["reward"] >= 0 for r in generations)
    assert json.loads((out / "run.json").read_text())["finished"]
