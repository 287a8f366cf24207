"""Recipes (recipes/**/*.yaml) and their parser (ncgrpo.commands.parser.ConfigParser over the training dataclasses):
flat TRL-style keys, base: includes, command-line flags, validation that names the file and the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from ncgrpo.commands.config_file import ConfigError, ParsedConfig, load_config_file
from ncgrpo.commands.parser import ConfigParser
from ncgrpo.commands.train_settings import ModelArguments, ScriptArguments, train_dataclasses

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
# recipes/verl/ holds verl's Hydra configs, not ncgrpo recipes (tests/integrations/test_verl.py composes them)
ALL_RECIPES = sorted(p for p in RECIPES.rglob("*.yaml") if not {"accelerate", "verl"} & set(p.parts))
RUN_RECIPES = sorted(RECIPES.glob("*.yaml"))  # runnable ones; recipes/base/ holds shared blocks
PAPER_RECIPES = [p for p in RUN_RECIPES if not p.name.startswith("tiny")]
ACCELERATE = RECIPES / "accelerate"
SERVER_RECIPE = RECIPES / "qwen2_5_vl_7b_latent_sigma0.2_server.yaml"
# recipes that stay on the transformers engine, and the NCGRPOConfig refusal that keeps them there
TRANSFORMERS_ONLY = {
    "qwen2_5_vl_7b_first_token_marginal.yaml": "runs on the transformers generate path only",
    "qwen2_5_vl_7b_latent_propagating.yaml": "propagating layer site",
}
ENGINE_KEYS = {"use_vllm"}  # plus every vllm_* key
# (attention heads, KV heads) from each model's public config.json: vLLM's tensor parallelism splits both
HEADS = {
    "Qwen/Qwen2.5-VL-7B-Instruct": (28, 4),
    "Qwen/Qwen2.5-VL-3B-Instruct": (16, 2),
    "Qwen/Qwen3-VL-8B-Thinking": (32, 8),
}
ROLLOUT_PROMPTS = 512  # NoisyRollout's rollout batch
PROMPTS_PER_STEP = 128  # paper, section 4.1


def parse(path: Path | None, *flags: str) -> ParsedConfig:
    args = (["--config", str(path)] if path is not None else []) + list(flags)
    return ConfigParser(train_dataclasses).parse_args(args).parsed_config


def trainer_values(parsed: ParsedConfig) -> dict:
    """The explicit NCGRPOConfig keys of a recipe (what the old trainer: section held)."""
    cls = train_dataclasses()[1]
    return {k: v for k, v in parsed.values[cls].items() if k in parsed.explicit}


def ncgrpo_only_fields() -> set[str]:
    """The fields NCGRPOConfig adds to TRL's GRPOConfig (the perturbation settings)."""
    from trl import GRPOConfig

    cls = train_dataclasses()[1]
    return {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(GRPOConfig)}


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
        "qwen2_5_vl_7b_first_token_marginal",
        "qwen2_5_vl_7b_latent_propagating",
        "qwen2_5_vl_3b_vanilla",
        "qwen2_5_vl_3b_latent_sigma0.2",
        "qwen3_vl_8b_thinking_vanilla",
        "qwen3_vl_8b_thinking_latent_sigma0.2",
    ):
        assert stem in names


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_and_validates(path: Path, tmp_path: Path) -> None:
    parsed = parse(path)
    script, model = parsed.build(ScriptArguments), parsed.build(ModelArguments)
    assert model.model_name_or_path and script.reward_funcs
    # a full round trip: the resolved dump loads back, with --config, to the same values
    dumped = tmp_path / "config.yaml"
    dumped.write_text(parsed.to_yaml())
    again = parse(dumped)
    assert again.to_dict() == parsed.to_dict()
    for cls in parsed.types:
        assert again.values[cls] == parsed.values[cls], cls.__name__


@pytest.mark.parametrize("path", RUN_RECIPES, ids=lambda p: p.name)
def test_recipe_builds_the_trainer_config(path: Path, tmp_path: Path) -> None:
    """NCGRPOConfig accepts every runnable recipe (bf16 off so it builds on a CPU)."""
    parsed = parse(path, "--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu")
    assert "rollout_method" in parsed.explicit, "runnable recipes name their method explicitly"
    config = parsed.build(train_dataclasses()[1])
    assert config.num_generations == parsed.get("num_generations")
    assert config.rollout_method == parsed.get("rollout_method")


def test_run_names_are_unique() -> None:
    names = [parse(p).get("run_name") for p in RUN_RECIPES]
    assert len(names) == len(set(names)) and all(names)


def test_paper_protocol_is_shared() -> None:
    """Section 4.1: every method shares every hyperparameter; only the perturbation differs."""
    method_keys = (ncgrpo_only_fields() - {"sigma_schedule", "schedule_gamma", "schedule_k_mid"}) | {
        "run_name"
    }
    method_keys |= ENGINE_KEYS  # where the rollouts are generated is not a hyperparameter (test_engine_*)
    by_model: dict[str, dict] = {}
    for path in PAPER_RECIPES:
        parsed = parse(path)
        t = trainer_values(parsed)
        # NoisyRollout's run: 60 rollout batches x 4 updates; eq. (3) counts rollout batches
        assert (t["max_steps"], t["schedule_unit"]) == (240, "generation")
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
        model, script = parsed.build(ModelArguments), parsed.build(ScriptArguments)
        assert model.freeze_vision_tower is True
        assert script.dataset_name == "geo3k" and script.dataset_train_split == "train"
        assert script.reward_funcs == ["math_reward"]
        shared = {k: v for k, v in t.items() if k not in method_keys and not k.startswith("vllm_")}
        ref = by_model.setdefault(model.model_name_or_path, shared)
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
        (
            "qwen2_5_vl_7b_first_token_temperature",
            {
                "rollout_method": "first_token_temperature",
                "first_token_temperature_auto": True,
                "sigma0": 0.2,
            },
        ),
        ("qwen2_5_vl_7b_first_token_marginal", {"rollout_method": "first_token_marginal", "sigma0": 0.2}),
        ("qwen2_5_vl_7b_latent_propagating", {"rollout_method": "latent", "noise_site": "14"}),
        ("qwen3_vl_8b_thinking_latent_sigma0.2", {"rollout_method": "latent", "sigma0": 0.2}),
    ],
)
def test_method_settings(stem: str, expected: dict) -> None:
    t = trainer_values(parse(RECIPES / f"{stem}.yaml"))
    for k, v in expected.items():
        assert t[k] == v, k


def test_model_variants_change_only_the_model() -> None:
    p3 = parse(RECIPES / "qwen2_5_vl_3b_vanilla.yaml")
    q3 = parse(RECIPES / "qwen3_vl_8b_thinking_vanilla.yaml")
    assert p3.get("model_name_or_path") == "Qwen/Qwen2.5-VL-3B-Instruct" and p3.get("min_pixels") == 262144
    assert q3.get("model_name_or_path") == "Qwen/Qwen3-VL-8B-Thinking"
    assert q3.get("min_pixels") is None and q3.get("max_pixels") is None  # the base's values, nulled
    assert p3.sources[1:] == [
        str(RECIPES / "base" / "geo3k_qwen2_5_vl_3b.yaml"),
        str(RECIPES / "base" / "geo3k_qwen2_5_vl_7b.yaml"),
    ]


# ------------------------------------------------------------------------------ rollout engine
def cli_parse(path: Path, *flags: str) -> ParsedConfig:
    """Through the command line's own parser (``ncgrpo train --config PATH ...``)."""
    from ncgrpo.cli import build_parser

    args = build_parser().parse_args(["train", "--config", str(path), *flags])
    return args.parsed_config


def trainer_config(parsed: ParsedConfig):
    return parsed.build(train_dataclasses()[1])


CPU = ("--bf16", "false", "--use_cpu")  # so NCGRPOConfig builds on a machine without a GPU


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_engine_paper_recipes_generate_with_vllm(path: Path, tmp_path: Path) -> None:
    """vLLM by default (colocated; the server recipe in server mode), except the two methods the plugin
    cannot run, which stay on the transformers engine explicitly."""
    parsed = cli_parse(path, "--output_dir", str(tmp_path), *CPU)
    config = trainer_config(parsed)
    if path.name in TRANSFORMERS_ONLY:
        assert config.use_vllm is False and "use_vllm" in load_config_file(path).values
        return
    assert config.use_vllm is True
    assert config.vllm_mode == ("server" if path == SERVER_RECIPE else "colocate")


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_engine_use_vllm_true_validates(path: Path, tmp_path: Path) -> None:
    """Every paper recipe parses with --use_vllm true; NCGRPOConfig accepts it, or refuses it before any
    engine starts with the reason (the two transformers-only methods)."""
    parsed = cli_parse(path, "--output_dir", str(tmp_path), "--use_vllm", "true", *CPU)
    assert parsed.get("use_vllm") is True
    if path.name in TRANSFORMERS_ONLY:
        with pytest.raises(NotImplementedError, match=TRANSFORMERS_ONLY[path.name]):
            trainer_config(parsed)
        return
    config = trainer_config(parsed)
    assert config.use_vllm is True and config.rollout_method == parsed.get("rollout_method")


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_engine_transformers_is_one_flag_away(path: Path, tmp_path: Path) -> None:
    """The documented override: --use_vllm false gives the transformers engine, the rest unchanged."""
    on = cli_parse(path, "--output_dir", str(tmp_path), *CPU)
    off = cli_parse(path, "--output_dir", str(tmp_path), "--use_vllm", "false", *CPU)
    assert trainer_config(off).use_vllm is False
    a, b = on.to_dict(), off.to_dict()
    assert {k for k in a if a[k] != b.get(k)} <= {"use_vllm"}


@pytest.mark.parametrize(
    "path", [p for p in PAPER_RECIPES if p.name not in TRANSFORMERS_ONLY], ids=lambda p: p.name
)
def test_engine_colocate_settings_fit_the_model_and_gpus(path: Path) -> None:
    """Tensor parallelism divides the 8 training processes and the model's heads; the engine sleeps while
    the trainer trains; its context holds the prompt and the whole response."""
    parsed = cli_parse(path)
    if parsed.get("vllm_mode") == "server":
        return
    tp = parsed.get("vllm_tensor_parallel_size")
    heads, kv_heads = HEADS[parsed.get("model_name_or_path")]
    for num_processes in (_accelerate("zero3_8gpu.yaml")["num_processes"], 16):
        assert num_processes % tp == 0  # TRL: tensor_parallel_size must divide the world size
    assert heads % tp == 0 and kv_heads % tp == 0
    assert 0 < parsed.get("vllm_gpu_memory_utilization") <= 0.5  # the README's arithmetic; see there
    assert parsed.get("vllm_enable_sleep_mode") is True
    # a Geometry3K prompt: <= 1,000,000 / 28^2 = 1,276 image tokens at max_pixels, plus the question
    assert parsed.get("vllm_max_model_length") >= parsed.get("max_completion_length") + 1536


def test_engine_readme_arithmetic_uses_the_recipes_values() -> None:
    """recipes/README.md's memory arithmetic is written for the base recipe's engine settings."""
    text = (RECIPES / "README.md").read_text()
    parsed = cli_parse(RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml")
    for key in ("vllm_tensor_parallel_size", "vllm_gpu_memory_utilization", "vllm_max_model_length"):
        assert f"`{key}: {parsed.get(key)}`" in text, key
    assert "`--use_vllm false`" in text
    assert "later work" not in text
    for path in ALL_RECIPES:
        assert "later work" not in path.read_text(), path.name


def test_engine_server_recipe(tmp_path: Path) -> None:
    """Two nodes: the main run in TRL's server mode, with the server command, the plugin check and the
    training command written in the recipe; the image method is refused in server mode."""
    parsed = cli_parse(SERVER_RECIPE, "--output_dir", str(tmp_path), "--vllm_server_host", "10.0.0.2", *CPU)
    config = trainer_config(parsed)
    assert (config.use_vllm, config.vllm_mode, config.vllm_server_host) == (True, "server", "10.0.0.2")
    assert config.rollout_method == "latent" and config.sigma0 == 0.2 and config.noise_site == "final_norm"
    latent = cli_parse(RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml")
    differs = {k for k, v in parsed.to_dict().items() if latent.to_dict().get(k) != v}
    assert {k for k in differs if not k.startswith("vllm_")} <= {"run_name", "output_dir", "bf16", "use_cpu"}
    text = SERVER_RECIPE.read_text()
    for needed in (
        "trl vllm-serve --model Qwen/Qwen2.5-VL-7B-Instruct",
        "--tensor_parallel_size 4",
        "check_server_plugin_active",
        'pip install -e ".[vllm]"',
        "accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml -m ncgrpo.cli train",
        f"--config recipes/{SERVER_RECIPE.name}",
    ):
        assert needed in text, needed
    assert HEADS["Qwen/Qwen2.5-VL-7B-Instruct"][1] % 4 == 0  # the server's TP 4 splits the 4 KV heads
    image = cli_parse(RECIPES / "qwen2_5_vl_7b_image.yaml", "--vllm_mode", "server", *CPU)
    with pytest.raises(NotImplementedError, match="vllm_mode='server' is not supported"):
        trainer_config(image)


def test_engine_tiny_cpu_recipe_stays_on_transformers(tmp_path: Path) -> None:
    config = trainer_config(cli_parse(RECIPES / "tiny_cpu_latent.yaml", "--output_dir", str(tmp_path)))
    assert config.use_vllm is False and config.use_cpu is True


# --------------------------------------------------------------------------- batch arithmetic
def _accelerate(name: str) -> dict:
    return yaml.safe_load((ACCELERATE / name).read_text())


def _completions_per_step(parsed: ParsedConfig, num_processes: int) -> int:
    return (
        parsed.get("per_device_train_batch_size") * num_processes * parsed.get("gradient_accumulation_steps")
    )


@pytest.mark.parametrize("path", PAPER_RECIPES, ids=lambda p: p.name)
def test_8gpu_step_is_128_prompts_times_12(path: Path) -> None:
    acc = _accelerate("zero3_8gpu.yaml")
    t = parse(path)
    g = t.get("num_generations")
    assert _completions_per_step(t, acc["num_processes"]) == PROMPTS_PER_STEP * g == 1536
    # TRL: generation_batch_size = per_device * processes * steps_per_generation (default: grad accum)
    steps_per_generation = t.get("steps_per_generation") or t.get("gradient_accumulation_steps")
    generation_batch = t.get("per_device_train_batch_size") * acc["num_processes"] * steps_per_generation
    assert generation_batch % g == 0
    assert generation_batch // g == ROLLOUT_PROMPTS  # NoisyRollout's rollout batch of 512 prompts
    assert steps_per_generation // t.get("gradient_accumulation_steps") == ROLLOUT_PROMPTS // PROMPTS_PER_STEP
    # K of eq. (3) in rollout batches: 240 optimizer steps / 4 updates per rollout batch = 60
    assert t.get("max_steps") * PROMPTS_PER_STEP // ROLLOUT_PROMPTS == 60


def test_multinode_arithmetic_with_documented_flag() -> None:
    acc = _accelerate("zero3_2x8gpu.yaml")
    assert (acc["num_machines"], acc["num_processes"]) == (2, 16)
    text = (ACCELERATE / "zero3_2x8gpu.yaml").read_text()
    assert "--gradient_accumulation_steps 24" in text and "--steps_per_generation 96" in text
    t = parse(RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml", "--gradient_accumulation_steps", "24")
    assert _completions_per_step(t, acc["num_processes"]) == PROMPTS_PER_STEP * t.get("num_generations")


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


# ------------------------------------------------------------------------------- flags and files
def test_flags_override_the_file_with_the_fields_types() -> None:
    p = parse(
        RECIPES / "qwen2_5_vl_7b_latent_sigma0.2.yaml",
        "--sigma0", "0.5",
        "--max_steps", "10",
        "--learning-rate", "2e-6",  # dash aliases, as HfArgumentParser gives
        "--bf16", "false",
        "--reward_weights", "1.0", "2.0",
        "--noise_site", "12",
        "--no_freeze_vision_tower",
        "--dataset_path", "/data/geo3k",
        "--dataset_train_limit", "16",
        "--run_name", "custom",
    )  # fmt: skip
    assert (p.get("sigma0"), p.get("max_steps"), p.get("learning_rate")) == (0.5, 10, 2e-6)
    assert p.get("bf16") is False and p.get("reward_weights") == [1.0, 2.0] and p.get("noise_site") == "12"
    assert p.get("freeze_vision_tower") is False
    assert p.get("dataset_path") == "/data/geo3k" and p.get("dataset_train_limit") == 16
    assert p.get("run_name") == "custom" and p.get("dataset_name") == "geo3k"
    # everything else still comes from the file and its base
    assert p.get("num_generations") == 12 and p.get("model_name_or_path") == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert "# command line: --sigma0 0.5 --max_steps 10" in p.to_yaml()
    assert {"sigma0", "freeze_vision_tower", "reward_weights"} <= set(p.explicit)


def test_file_scalars_convert_like_flags(tmp_path: Path) -> None:
    """One conversion rule: a YAML 1.1 string such as 1e-6 is a float for a float field, a number is a
    string for a str field, null is None for an optional field."""
    f = _write(tmp_path / "r.yaml", MINIMAL + "learning_rate: 1e-6\nnoise_site: 14\nmin_pixels: null\n")
    p = parse(f)
    assert p.get("learning_rate") == 1e-6 and isinstance(p.get("learning_rate"), float)
    assert p.get("noise_site") == "14" and p.get("min_pixels") is None


def test_lists_and_mappings_in_files(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "r.yaml",
        MINIMAL + "reward_funcs: accuracy_reward\neval_dataset_splits: [validation, test]\n"
        "activation_checkpointing_kwargs: {use_reentrant: false}\n",
    )
    p = parse(f)
    assert p.get("reward_funcs") == ["accuracy_reward"]  # a scalar for a list field is a one-item list
    assert p.get("eval_dataset_splits") == ["validation", "test"]
    assert p.get("activation_checkpointing_kwargs") == {"use_reentrant": False}


def test_dataclasses_are_built_on_first_use() -> None:
    calls = []

    def types():
        calls.append(1)
        return (ScriptArguments,)

    parser = ConfigParser(types)
    assert calls == []
    assert "--dataset_name" in parser.format_help() and calls == [1]
    (script,) = parser.parse_args_and_config(["--dataset_name", "synthetic", "--dataset_train_split", "test"])
    assert (script.dataset_name, script.dataset_train_split) == ("synthetic", "test") and calls == [1]


@pytest.mark.parametrize("method", ["parse_args_and_config", "parse_args_into_dataclasses"])
def test_parse_args_and_config_returns_the_dataclasses(tmp_path: Path, method: str) -> None:
    parser = ConfigParser(train_dataclasses())
    script, config, model = getattr(parser, method)(
        ["--config", str(RECIPES / "tiny_cpu_latent.yaml"), "--output_dir", str(tmp_path), "--sigma0", "0.3"]
    )
    assert isinstance(script, ScriptArguments) and isinstance(model, ModelArguments)
    assert (config.sigma0, config.max_steps, str(config.output_dir)) == (0.3, 2, str(tmp_path))
    assert script.dataset_name == "synthetic" and model.dtype == "float32"  # from the file


# ------------------------------------------------------------------------------------ errors
def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


MINIMAL = """\
model_name_or_path: /models/tiny
dataset_name: geo3k
dataset_path: /data/geo3k
rollout_method: latent
sigma0: 0.2
"""


@pytest.mark.parametrize(
    ("bad", "key", "suggestion"),
    [
        ("freeze_vision: true", "freeze_vision", "freeze_vision_tower"),
        ("dataset_pth: /d", "dataset_pth", "dataset_path"),
        ("sigma_0: 0.2", "sigma_0", "sigma0"),
        ("learnin_rate: 1.0e-6", "learnin_rate", "learning_rate"),
        ("rollout_methd: latent", "rollout_methd", "rollout_method"),
        ("dtyp: float32", "dtyp", "dtype"),
    ],
)
def test_unknown_keys_name_the_file_and_suggest(tmp_path: Path, bad: str, key: str, suggestion: str) -> None:
    _write(tmp_path / "base.yaml", MINIMAL)
    p = _write(tmp_path / "r.yaml", f"base: base.yaml\n{bad}\n")
    with pytest.raises(ConfigError) as e:
        parse(p)
    assert str(e.value).startswith(f"{p}: unknown key '{key}'")
    assert f"(did you mean '{suggestion}'?)" in str(e.value)


def test_unknown_key_without_close_match_has_no_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        parse(_write(tmp_path / "r.yaml", MINIMAL + "zzzqqq: 1\n"))
    assert "unknown key 'zzzqqq'" in str(e.value) and "did you mean" not in str(e.value)


def test_old_nested_format_is_an_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'trainer'"):
        parse(_write(tmp_path / "r.yaml", "trainer: {sigma0: 0.2}\n"))


def test_unknown_flags_and_positionals(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"unknown option --sigma_0 \(did you mean '--sigma0'\?\)"):
        parse(p, "--sigma_0", "0.3")
    with pytest.raises(ConfigError, match=r"unexpected argument 'trainer.sigma0=0.5'.*--sigma0 0.5"):
        parse(p, "trainer.sigma0=0.5")
    with pytest.raises(ConfigError, match="unknown option --learning"):  # no silent abbreviations
        parse(p, "--learning", "1e-5")


def test_error_in_base_names_the_base_file(tmp_path: Path) -> None:
    base = _write(tmp_path / "base" / "b.yaml", MINIMAL.replace("sigma0", "sigmaa0"))
    p = _write(tmp_path / "r.yaml", "base: base/b.yaml\nrun_name: r\n")
    with pytest.raises(ConfigError) as e:
        parse(p)
    assert str(e.value).startswith(f"{base}: unknown key 'sigmaa0'")


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("learning_rate: fast", r"r\.yaml: 'learning_rate': invalid float value 'fast'"),
        ("max_steps: 1.5", r"r\.yaml: 'max_steps': invalid int value 1.5"),
        ("bf16: [1]", r"r\.yaml: 'bf16' takes one value"),
        ("dtype: int8", r"r\.yaml: 'dtype' must be one of auto, bfloat16, float16, float32; got 'int8'"),
        ("save_strategy: no", r"r\.yaml: 'save_strategy' is not a true/false field.*quote it"),
        ("max_steps: null", r"r\.yaml: 'max_steps' cannot be null"),
    ],
)
def test_bad_values_name_file_and_key(tmp_path: Path, line: str, match: str) -> None:
    key = line.split(":", 1)[0]
    rest = "".join(f"{x}\n" for x in MINIMAL.splitlines() if not x.startswith(f"{key}:"))  # one key once
    with pytest.raises(ConfigError, match=match):
        parse(_write(tmp_path / "r.yaml", rest + line + "\n"))


def test_bad_flag_values(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(ConfigError, match=r"argument --learning_rate.*invalid float value: 'fast'"):
        parse(p, "--learning_rate", "fast")
    with pytest.raises(ConfigError, match=r"argument --dtype.*invalid choice: 'int8'"):
        parse(p, "--dtype", "int8")


def test_dataclass_validation(tmp_path: Path) -> None:
    p = _write(tmp_path / "r.yaml", MINIMAL)
    with pytest.raises(
        ValueError, match=r"unknown reward function 'math_rewards' \(did you mean 'math_reward'\?\)"
    ):
        parse(p, "--reward_funcs", "math_rewards").build(ScriptArguments)
    # dataset_name: a built-in name or a data file of one's own (issue 44), so no argparse choices
    with pytest.raises(
        ValueError, match=r"dataset_name 'mnist': not a built-in dataset \(geo3k, synthetic, gsm8k, math500\)"
    ):
        parse(p, "--dataset_name", "mnist").build(ScriptArguments)
    with pytest.raises(
        ValueError, match=r"dataset_name 'geo4k' \(did you mean 'geo3k'\?\): not a built-in dataset"
    ):
        parse(p, "--dataset_name", "geo4k").build(ScriptArguments)
    with pytest.raises(ValueError, match="dataset_train_limit must be a positive"):
        parse(p, "--dataset_train_limit", "0").build(ScriptArguments)
    with pytest.raises(ValueError, match="synthetic suite has splits train, validation, test"):
        parse(p, "--dataset_name", "synthetic", "--dataset_train_split", "dev").build(ScriptArguments)
    with pytest.raises(ValueError, match="model_name_or_path is required"):
        parse(None).build(ModelArguments)
    with pytest.raises(ValueError, match="min_pixels=9 is above max_pixels=4"):
        parse(p, "--min_pixels", "9", "--max_pixels", "4").build(ModelArguments)


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--load_in_4bit"], "4-bit"),
        (["--load_in_8bit"], "8-bit"),
        (["--model_revision", "v2"], "hub revisions"),
    ],
)
def test_model_config_features_not_wired_are_refused(tmp_path: Path, flags: list, what: str) -> None:
    p = parse(_write(tmp_path / "r.yaml", MINIMAL), *flags)
    with pytest.raises(ValueError, match=f"ncgrpo does not support {what}"):
        p.build(ModelArguments)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        parse(_write(tmp_path / "c.yaml", "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse(_write(tmp_path / "d.yaml", "model_name_or_path: [\n"))
    with pytest.raises(ConfigError, match=r"missing\.yaml: config file does not exist"):
        parse(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="--config needs a file"):
        parse(None, "--config")


# ------------------------------------------------------------------------------------ base:
def test_base_chain_merges_base_first(tmp_path: Path) -> None:
    _write(tmp_path / "root.yaml", MINIMAL + "max_steps: 60\nreward_weights: [1.0, 2.0]\nrun_name: root\n")
    _write(tmp_path / "mid" / "mid.yaml", "base: ../root.yaml\nmax_steps: 30\n")
    leaf = _write(
        tmp_path / "leaf.yaml",
        "base: mid/mid.yaml\nrun_name: leaf\nsigma0: 0.5\nreward_weights: [3.0]\ndtype: float32\n",
    )
    p = parse(leaf)
    assert p.get("run_name") == "leaf"
    assert p.get("max_steps") == 30 and p.get("sigma0") == 0.5
    assert p.get("rollout_method") == "latent"  # from root, through mid
    assert p.get("reward_weights") == [3.0]  # a value of the extending file replaces the base's
    assert p.get("model_name_or_path") == "/models/tiny" and p.get("dtype") == "float32"
    assert p.sources == [
        str(leaf),
        str(tmp_path / "mid" / "mid.yaml"),
        str(tmp_path / "mid" / ".." / "root.yaml"),
    ]
    f = load_config_file(leaf)
    assert f.origin["max_steps"] == str(tmp_path / "mid" / "mid.yaml") and f.origin["sigma0"] == str(leaf)


def test_base_cycle_and_missing_base(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"include cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        parse(tmp_path / "a.yaml")
    c = _write(tmp_path / "c.yaml", "base: nope.yaml\n")
    with pytest.raises(ConfigError, match=rf"{c}: base file .*nope\.yaml does not exist"):
        parse(c)
    with pytest.raises(ConfigError, match="'base' must be a file path"):
        parse(_write(tmp_path / "d.yaml", "base: [a.yaml]\n"))


def test_a_key_given_twice_is_an_error_naming_it_and_both_lines(tmp_path: Path) -> None:
    """YAML's loaders keep the last of two equal keys without a word (issue 35): `sigma0: 0.2` then,
    further down, `sigma0: 0.5` ran with 0.5. In a base file too, and in a nested mapping; a key of an
    including file that replaces its base's is what `base:` is for, and stays allowed."""
    twice = _write(tmp_path / "twice.yaml", MINIMAL + "max_steps: 3\nlearning_rate: 1.0e-6\nmax_steps: 4\n")
    n = MINIMAL.count("\n")
    with pytest.raises(
        ConfigError,
        match=rf"{re.escape(str(twice))}: key 'max_steps' is given twice \(lines {n + 1} and {n + 3}\)",
    ):
        parse(twice)
    _write(tmp_path / "base.yaml", "max_steps: 3\nmax_steps: 4\n")
    leaf = _write(tmp_path / "leaf.yaml", MINIMAL + "base: base.yaml\n")
    with pytest.raises(
        ConfigError,
        match=rf"base\.yaml \(the base of {re.escape(str(leaf))}\): key 'max_steps' is given twice \(lines 1 and 2\)",
    ):
        parse(leaf)
    nested = _write(
        tmp_path / "nested.yaml",
        MINIMAL + "env:\n  HF_HOME: /a\n  HF_HOME: /b\n",
    )
    with pytest.raises(ConfigError, match=r"key 'HF_HOME' is given twice"):
        parse(nested)
    _write(tmp_path / "base2.yaml", MINIMAL + "max_steps: 3\n")
    assert parse(_write(tmp_path / "over.yaml", "base: base2.yaml\nmax_steps: 4\n")).get("max_steps") == 4


def test_env_mapping_and_vars_in_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCGRPO_TEST_DATA", "/data/g3k")
    monkeypatch.delenv("NCGRPO_TEST_ENV", raising=False)
    f = _write(
        tmp_path / "r.yaml",
        MINIMAL.replace("/data/geo3k", '"${NCGRPO_TEST_DATA}/train"') + "env: {NCGRPO_TEST_ENV: on}\n",
    )
    p = parse(f)
    assert p.build(ScriptArguments).dataset_path == "/data/g3k/train"
    import os

    assert (
        os.environ["NCGRPO_TEST_ENV"] == "on"
    )  # set as written when the file is read (issue 26: not "True")


def test_every_field_has_help() -> None:
    for cls in (ScriptArguments, ModelArguments):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_without_dataclasses_it_is_a_plain_argparse_parser(capsys) -> None:
    parser = ConfigParser(prog="x")
    parser.add_argument("--n", type=int)
    assert parser.parse_args(["--n", "3"]).n == 3
    with pytest.raises(SystemExit):  # argparse's own error handling, no --config
        parser.parse_args(["--config", "a.yaml"])
    assert "unrecognized arguments: --config a.yaml" in capsys.readouterr().err
