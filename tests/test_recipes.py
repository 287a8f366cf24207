"""Recipes (recipes/**/*.yaml) and their loader (ncgrpo.config): includes, overrides, validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from ncgrpo.config import (
    NCGRPO_FIELDS,
    RecipeError,
    load_recipe,
    parse_override,
    parse_value,
    trainer_field_types,
)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
ALL_RECIPES = sorted(p for p in RECIPES.rglob("*.yaml") if "accelerate" not in p.parts)
RUN_RECIPES = sorted(RECIPES.glob("*.yaml"))  # runnable ones; recipes/base/ holds shared blocks
PAPER_RECIPES = [p for p in RUN_RECIPES if not p.name.startswith("tiny")]
ACCELERATE = RECIPES / "accelerate"
PROMPTS_PER_STEP = 128  # paper, section 4.1


def _config_class():
    try:
        from ncgrpo.trainer import NCGRPOConfig
    except ImportError:
        return None
    return NCGRPOConfig


# ------------------------------------------------------------------------------- the recipe files
def test_recipes_exist() -> None:
    names = {p.stem for p in RUN_RECIPES}
    for stem in (
        "qwen2_5_vl_7b_vanilla",
        "qwen2_5_vl_7b_latent_sigma0.2",
        "qwen2_5_vl_7b_latent_sigma0.5",
        "qwen2_5_vl_7b_latent_sigma0.3",
        "qwen2_5_vl_7b_latent_sigma0.4",
        "qwen2_5_vl_7b_image",
        "qwen2_5_vl_7b_antithetic",
        "qwen2_5_vl_7b_antithetic_separate",
        "qwen2_5_vl_7b_spsa",
        "qwen2_5_vl_7b_first_token_temperature",
        "qwen2_5_vl_7b_latent_propagating",
        "qwen2_5_vl_3b_vanilla",
        "qwen2_5_vl_3b_latent_sigma0.2",
        "qwen3_vl_8b_thinking_vanilla",
        "qwen3_vl_8b_thinking_latent_sigma0.2",
    ):
        assert stem in names


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_and_validates(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.model.name_or_path
    assert recipe.rewards
    # a full round trip: the resolved dump loads back to the same recipe
    dumped = yaml.safe_load(recipe.to_yaml())
    assert dumped == recipe.to_dict()


@pytest.mark.parametrize("path", RUN_RECIPES, ids=lambda p: p.name)
def test_recipe_builds_the_trainer_config(path: Path, tmp_path: Path) -> None:
    """NCGRPOConfig (or TRL's GRPOConfig before it exists) accepts every runnable recipe's trainer block."""
    recipe = load_recipe(path)
    assert "rollout_method" in recipe.trainer, "runnable recipes name their method explicitly"
    kwargs = recipe.trainer_kwargs(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    cls = _config_class()
    if cls is None:
        from trl import GRPOConfig as cls  # noqa: N813

        kwargs = {k: v for k, v in kwargs.items() if k not in NCGRPO_FIELDS}
    config = cls(**kwargs)
    assert config.num_generations == recipe.trainer["num_generations"]


def test_run_names_are_unique() -> None:
    names = [load_recipe(p).name for p in RUN_RECIPES]
    assert len(names) == len(set(names))


def test_paper_protocol_is_shared() -> None:
    """Section 4.1: every method shares every hyperparameter; only the perturbation differs."""
    method_keys = set(NCGRPO_FIELDS) - {"sigma_schedule", "schedule_gamma", "schedule_k_mid"}
    by_model: dict[str, dict] = {}
    for path in PAPER_RECIPES:
        recipe = load_recipe(path)
        t = recipe.trainer
        assert t["max_steps"] == 60
        assert t["num_generations"] == 12
        assert t["max_completion_length"] == 2048
        assert t["learning_rate"] == pytest.approx(1e-6)
        assert t["beta"] == 0.0
        assert (t["schedule_gamma"], t["schedule_k_mid"], t["sigma_schedule"]) == (30.0, 40.0, "sigmoid")
        assert (t["weight_decay"], t["max_grad_norm"], t["epsilon"], t["temperature"]) == (
            1e-2,
            1.0,
            0.2,
            1.0,
        )
        assert t["bf16"] is True
        assert recipe.model.freeze_vision_tower is True
        assert recipe.data.train.name == "geo3k" and recipe.data.train.split == "train"
        assert recipe.rewards == ["math_reward"]
        shared = {k: v for k, v in t.items() if k not in method_keys}
        ref = by_model.setdefault(recipe.model.name_or_path, shared)
        assert shared == ref, f"{path.name} changes a shared hyperparameter"
    assert len(by_model) == 3


@pytest.mark.parametrize(
    ("stem", "expected"),
    [
        ("qwen2_5_vl_7b_vanilla", {"rollout_method": "vanilla"}),
        (
            "qwen2_5_vl_7b_latent_sigma0.2",
            {"rollout_method": "latent", "sigma0": 0.2, "noise_site": "final_norm"},
        ),
        ("qwen2_5_vl_7b_latent_sigma0.5", {"rollout_method": "latent", "sigma0": 0.5}),
        ("qwen2_5_vl_7b_latent_sigma0.3", {"rollout_method": "latent", "sigma0": 0.3}),
        ("qwen2_5_vl_7b_latent_sigma0.4", {"rollout_method": "latent", "sigma0": 0.4}),
        ("qwen2_5_vl_7b_image", {"rollout_method": "image", "image_noise_step": 500}),
        ("qwen2_5_vl_7b_antithetic", {"rollout_method": "antithetic", "antithetic_grouping": "joint"}),
        (
            "qwen2_5_vl_7b_antithetic_separate",
            {"rollout_method": "antithetic", "antithetic_grouping": "separate"},
        ),
        ("qwen2_5_vl_7b_spsa", {"rollout_method": "spsa", "sigma0": 0.2}),
        ("qwen2_5_vl_7b_first_token_temperature", {"rollout_method": "first_token_temperature"}),
        ("qwen2_5_vl_7b_latent_propagating", {"rollout_method": "latent", "noise_site": "14"}),
        ("qwen3_vl_8b_thinking_latent_sigma0.2", {"rollout_method": "latent", "sigma0": 0.2}),
    ],
)
def test_method_settings(stem: str, expected: dict) -> None:
    t = load_recipe(RECIPES / f"{stem}.yaml").trainer
    for k, v in expected.items():
        assert t[k] == v, k


# --------------------------------------------------------------------------- batch arithmetic
def _accelerate(name: str) -> dict:
    return yaml.safe_load((ACCELERATE / name).read_text())


def _completions_per_step(trainer: dict, num_processes: int) -> int:
    return trainer["per_device_train_batch_size"] * num_processes * trainer["gradient_accumulation_steps"]


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_8gpu_step_is_128_prompts_times_12(path: Path) -> None:
    acc = _accelerate("zero3_8gpu.yaml")
    t = load_recipe(path).trainer
    per_step = _completions_per_step(t, acc["num_processes"])
    assert per_step == PROMPTS_PER_STEP * t["num_generations"] == 1536
    # TRL: generation_batch_size = per_device * processes * steps_per_generation (default: grad accum)
    steps_per_generation = t.get("steps_per_generation") or t["gradient_accumulation_steps"]
    generation_batch = t["per_device_train_batch_size"] * acc["num_processes"] * steps_per_generation
    assert generation_batch % t["num_generations"] == 0
    assert generation_batch // t["num_generations"] == PROMPTS_PER_STEP  # one generation per step


def test_multinode_arithmetic_with_documented_override() -> None:
    acc = _accelerate("zero3_2x8gpu.yaml")
    assert (acc["num_machines"], acc["num_processes"]) == (2, 16)
    text = (ACCELERATE / "zero3_2x8gpu.yaml").read_text()
    assert "trainer.gradient_accumulation_steps=24" in text
    t = load_recipe(
        RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml", ["trainer.gradient_accumulation_steps=24"]
    ).trainer
    assert _completions_per_step(t, acc["num_processes"]) == PROMPTS_PER_STEP * t["num_generations"]


@pytest.mark.parametrize("name", ["zero3_8gpu.yaml", "zero3_2x8gpu.yaml"])
def test_accelerate_configs_are_zero3(name: str) -> None:
    acc = _accelerate(name)
    assert acc["distributed_type"] == "DEEPSPEED"
    assert acc["deepspeed_config"]["zero_stage"] == 3
    assert acc["mixed_precision"] == "bf16"
    assert acc["num_processes"] == 8 * acc["num_machines"]


def test_readme_shows_the_launch_command() -> None:
    text = (RECIPES / "README.md").read_text()
    assert "accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml -m ncgrpo.cli train" in text


# ---------------------------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3", 3),
        ("-7", -7),
        ("0.5", 0.5),
        ("1e-6", 1e-6),  # plain PyYAML would give the string "1e-6"
        ("5E3", 5000.0),
        ("true", True),
        ("False", False),
        ("no", "no"),  # YAML 1.2: not a boolean (save_strategy=no)
        ("null", None),
        ("none", "none"),  # report_to=none
        ("[1, 2.5, x]", [1, 2.5, "x"]),
        ("{a: 1}", {"a": 1}),
        ("final_norm", "final_norm"),
        ('"14"', "14"),
        ("10,14", "10,14"),
        ("a=b", "a=b"),
        ("[unclosed", "[unclosed"),
    ],
)
def test_parse_value(text: str, value) -> None:
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_parse_override_dotted_keys() -> None:
    assert parse_override("trainer.sigma0=0.5") == (["trainer", "sigma0"], 0.5)
    assert parse_override("data.train.path=/x/y=z") == (["data", "train", "path"], "/x/y=z")
    for bad in ("trainer.sigma0", "=3", "trainer..sigma0=1"):
        with pytest.raises(RecipeError):
            parse_override(bad)


def test_overrides_apply_with_types() -> None:
    r = load_recipe(
        RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml",
        [
            "trainer.sigma0=0.5",
            "trainer.max_steps=10",
            "trainer.learning_rate=2e-6",
            "trainer.bf16=false",
            "trainer.reward_weights=[1.0]",
            "trainer.noise_site=12",  # a number for a str field becomes the string "12"
            "model.freeze_vision_tower=false",
            "data.train.path=/data/geo3k",
            "data.train.limit=16",
            "name=custom",
        ],
    )
    t = r.trainer
    assert t["sigma0"] == 0.5 and t["max_steps"] == 10 and t["learning_rate"] == 2e-6
    assert t["bf16"] is False and t["reward_weights"] == [1.0] and t["noise_site"] == "12"
    assert r.model.freeze_vision_tower is False
    assert r.data.train.path == "/data/geo3k" and r.data.train.limit == 16 and r.data.train.name == "geo3k"
    assert r.name == "custom"
    assert r.overrides[0] == "trainer.sigma0=0.5"
    assert "#   override: trainer.sigma0=0.5" in r.to_yaml()
    # everything else still comes from the base
    assert t["num_generations"] == 12 and r.model.name_or_path == "Qwen/Qwen2.5-VL-7B-Instruct"


def test_override_can_set_a_list_section() -> None:
    r = load_recipe(
        RECIPES / "qwen2_5_vl_7b_vanilla.yaml",
        ["data.eval=[{name: geo3k, split: validation, limit: 8}]"],
    )
    assert len(r.data.eval) == 1 and r.data.eval[0].split == "validation" and r.data.eval[0].limit == 8


# ------------------------------------------------------------------------------------ errors
def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


MINIMAL = """\
model: {name_or_path: /models/tiny}
data: {train: {name: geo3k, path: /data/geo3k}}
trainer:
  rollout_method: latent
  sigma0: 0.2
"""


def test_unknown_trainer_key_names_file_key_and_suggestion(tmp_path: Path) -> None:
    p = _write(tmp_path / "recipes" / "x.yaml", MINIMAL.replace("sigma0: 0.2", "sigma_0: 0.2"))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: unknown key 'sigma_0'")
    assert "(did you mean 'sigma0'?)" in msg
    assert "'trainer'" in msg


@pytest.mark.parametrize(
    ("bad", "key", "suggestion"),
    [
        ("model: {name_or_path: /m, freeze_vision: true}", "freeze_vision", "freeze_vision_tower"),
        ("data: {train: {name: geo3k, pth: /d}}", "pth", "path"),
        ("trainers: {}", "trainers", "trainer"),
        ("trainer: {learnin_rate: 1.0e-6}", "learnin_rate", "learning_rate"),
        ("trainer: {rollout_methd: latent}", "rollout_methd", "rollout_method"),
    ],
)
def test_unknown_keys_everywhere(tmp_path: Path, bad: str, key: str, suggestion: str) -> None:
    _write(tmp_path / "base.yaml", MINIMAL)
    p = _write(tmp_path / "r.yaml", f"base: base.yaml\n{bad}\n")
    with pytest.raises(RecipeError, match=rf"r\.yaml: unknown key '{key}'.*did you mean '{suggestion}'"):
        load_recipe(p)


def test_unknown_key_without_close_match_has_no_suggestion(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL + "  zzzqqq: 1\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "unknown key 'zzzqqq'" in str(e.value) and "did you mean" not in str(e.value)


def test_unknown_override_key_names_the_override(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(RecipeError, match=r"override 'trainer.sigma_0=0.3': unknown key 'sigma_0'.*'sigma0'"):
        load_recipe(p, ["trainer.sigma_0=0.3"])
    with pytest.raises(RecipeError, match=r"override 'modle.x=1': unknown key 'modle'.*'model'"):
        load_recipe(p, ["modle.x=1"])


def test_error_in_base_names_the_base_file(tmp_path: Path) -> None:
    _write(tmp_path / "base" / "b.yaml", MINIMAL.replace("sigma0", "sigmaa0"))
    p = _write(tmp_path / "r.yaml", "base: base/b.yaml\nname: r\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value).startswith(str((tmp_path / "base" / "b.yaml").resolve()))


def test_type_errors(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(RecipeError, match=r"'trainer.learning_rate' should be float, got 'fast'"):
        load_recipe(p, ["trainer.learning_rate=fast"])
    with pytest.raises(RecipeError, match=r"'trainer.max_steps' should be int"):
        load_recipe(p, ["trainer.max_steps=1.5"])
    with pytest.raises(RecipeError, match=r"'trainer.bf16'"):
        load_recipe(p, ["trainer.bf16=[1]"])
    with pytest.raises(RecipeError, match=r"model.torch_dtype"):
        load_recipe(p, ["model.torch_dtype=int8"])
    with pytest.raises(RecipeError, match=r"data.train.name"):
        load_recipe(p, ["data.train.name=mnist"])
    with pytest.raises(RecipeError, match=r"unknown reward 'math_rewards'.*did you mean 'math_reward'"):
        load_recipe(p, ["rewards=[math_rewards]"])


def test_required_sections(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="model.name_or_path' is required"):
        load_recipe(_write(tmp_path / "a.yaml", "data: {train: {name: geo3k}}\n"))
    with pytest.raises(RecipeError, match="data.train' is required"):
        load_recipe(_write(tmp_path / "b.yaml", "model: {name_or_path: /m}\n"))
    with pytest.raises(RecipeError, match="mapping at the top level"):
        load_recipe(_write(tmp_path / "c.yaml", "- 1\n- 2\n"))
    with pytest.raises(RecipeError, match="invalid YAML"):
        load_recipe(_write(tmp_path / "d.yaml", "model: [\n"))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")


# ------------------------------------------------------------------------------------ base:
def test_base_merges_depth_first_and_replaces_lists(tmp_path: Path) -> None:
    _write(
        tmp_path / "root.yaml",
        MINIMAL + "  max_steps: 60\n  reward_weights: [1.0, 2.0]\n" + "name: root\n",
    )
    _write(tmp_path / "mid" / "mid.yaml", "base: ../root.yaml\ntrainer: {max_steps: 30}\n")
    p = _write(
        tmp_path / "leaf.yaml",
        "base: mid/mid.yaml\nname: leaf\ntrainer: {sigma0: 0.5, reward_weights: [3.0]}\nmodel: {torch_dtype: float32}\n",
    )
    r = load_recipe(p)
    assert r.name == "leaf"
    assert r.trainer["max_steps"] == 30 and r.trainer["sigma0"] == 0.5
    assert r.trainer["rollout_method"] == "latent"  # from root, through mid
    assert r.trainer["reward_weights"] == [3.0]  # lists are replaced, not merged
    assert r.model.name_or_path == "/models/tiny" and r.model.torch_dtype == "float32"
    assert r.bases == [
        str((tmp_path / "mid" / "mid.yaml").resolve()),
        str((tmp_path / "root.yaml").resolve()),
    ]


def test_name_defaults_to_file_stem(tmp_path: Path) -> None:
    assert load_recipe(_write(tmp_path / "my-run.yaml", MINIMAL)).name == "my-run"


def test_base_cycle_and_missing_base(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    with pytest.raises(RecipeError, match="base recipe .*nope.yaml does not exist"):
        load_recipe(_write(tmp_path / "c.yaml", "base: nope.yaml\n"))


def test_env_vars_in_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCGRPO_TEST_DATA", "/data/g3k")
    p = _write(tmp_path / "r.yaml", MINIMAL.replace("/data/geo3k", '"${NCGRPO_TEST_DATA}/train"'))
    assert load_recipe(p).data.train.path == "/data/g3k/train"


def test_trainer_fields_cover_config_names() -> None:
    types = trainer_field_types()
    for name in NCGRPO_FIELDS:
        assert name in types
    cls = _config_class()
    if cls is not None:  # once NCGRPOConfig exists, its defaults are the ones config_names.md lists
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name, default in NCGRPO_FIELDS.items():
            assert defaults[name] == default, name
