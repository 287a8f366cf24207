"""Bounds, quiet no-ops and cryptic messages (issue 35): values with a physical range are refused where
they are parsed, naming the field or flag, before anything is loaded or written.

Each test here failed on main before issue 35: the values were taken (a dry run wrote its folder) and
refused only after the model had loaded, or trained nothing and reported success, or ended in an
internal error.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ncgrpo.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu_latent.yaml"
MODEL = str(ROOT / "src" / "ncgrpo" / "toy" / "assets" / "base")


def _cfg(tmp_path, **kw):
    from ncgrpo.trainer import NCGRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8)
    return NCGRPOConfig(**{**base, **kw})


def _train(out: Path | str, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(TINY_RECIPE),
        "--model_name_or_path",
        MODEL,
        "--output_dir",
        str(out),
        *extra,
    ]


# ---------------------------------------------- TRL's fields refused at parse time, naming the field
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"seed": -1}, r"seed must be an integer in \[0, 4294967295\].*got -1"),
        ({"seed": 2**32}, r"seed must be an integer in \[0, 4294967295\]"),
        ({"temperature": 0.0}, r"temperature must be a finite number > 0.*got 0.0"),
        ({"temperature": float("nan")}, r"temperature must be a finite number > 0"),
        ({"max_completion_length": 0}, r"max_completion_length must be an integer >= 1.*got 0"),
        ({"num_generations": -4}, r"num_generations must be an integer >= 2.*got -4"),
        ({"num_generations": 0}, r"num_generations must be an integer >= 2.*got 0"),
        (
            {"num_train_epochs": 0, "max_steps": -1},
            r"num_train_epochs must be a finite number > 0 .*train 0 steps",
        ),  # TRL: ZeroDivisionError
    ],
)
def test_config_refuses_trl_fields_out_of_range_naming_the_field(tmp_path, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_config_keeps_the_edges_of_those_ranges(tmp_path) -> None:
    cfg = _cfg(
        tmp_path,
        seed=0,
        temperature=1e-3,
        max_completion_length=1,
        num_generations=2,
        rollout_method="vanilla",
    )
    assert (cfg.seed, cfg.max_completion_length, cfg.num_generations) == (0, 1, 2)
    assert _cfg(tmp_path, seed=2**32 - 1, max_completion_length=None).max_completion_length is None
    assert _cfg(tmp_path, num_train_epochs=0, max_steps=5).max_steps == 5  # max_steps set: epochs unused


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (("--seed", "-1"), "seed"),
        (("--temperature", "0"), "temperature"),
        (("--max_completion_length", "0"), "max_completion_length"),
        (("--num_generations", "-4"), "num_generations"),
    ],
)
def test_train_refuses_them_before_loading_or_writing(tmp_path, capsys, flags, field) -> None:
    """docs/cli.md: `ncgrpo train` checks every setting before it loads the model and writes nothing;
    a dry run of these wrote config.yaml and run.json and a real run refused them after the model loaded."""
    out = tmp_path / "run"
    assert main(_train(out, "--dry-run", *flags)) == 2
    err = capsys.readouterr().err
    assert (
        f"ncgrpo train: error: {TINY_RECIPE}: trainer settings rejected by NCGRPOConfig: {field} must be"
        in err
    )
    assert "Traceback" not in err
    assert not out.exists()


# ---------------------------------------------------- a library run that would train 0 steps
def _tiny_grpo():
    import importlib.util
    import sys

    if "tiny_grpo" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "tiny_grpo", ROOT / "tests" / "scripts" / "tiny_grpo.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiny_grpo"] = module
        spec.loader.exec_module(module)
    return sys.modules["tiny_grpo"]


def test_trainer_refuses_a_training_set_smaller_than_one_generation_batch(tmp_path) -> None:
    """1 prompt for a generation batch of 2 (4 rows / num_generations 2): TRL's sampler drops the
    incomplete batch, so the run trained 0 steps, saved the base weights and reported success."""
    tiny = _tiny_grpo()
    small = dict(per_device_train_batch_size=4, num_generations=2, max_steps=1)
    with pytest.raises(
        ValueError,
        match=r"the training set has 1 prompts but one generation batch takes 2 "
        r"\(per_device_train_batch_size 4 x 1 processes x steps_per_generation 1 / num_generations 2\)",
    ):
        tiny.trainer(tmp_path / "one", n_prompts=1, **small)
    # refused before the model loads: a model path that does not exist is not reached
    from ncgrpo.trainer import NCGRPOTrainer

    with pytest.raises(ValueError, match="the training set has 1 prompts"):
        NCGRPOTrainer(
            str(tmp_path / "no-model"),
            [tiny.hash_reward],
            tiny.config(tmp_path / "x", **small),
            tiny.dataset(1),
        )
    assert (
        tiny.trainer(tmp_path / "two", n_prompts=2, **small).args.generation_batch_size == 4
    )  # exactly one batch


# ------------------------------------------------------------------ empty paths are errors
@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["train", "--config", str(TINY_RECIPE), "--output_dir", ""], "--output_dir"),
        (["train", "--config", str(TINY_RECIPE), "--dataset_path="], "--dataset_path"),
        (["eval", "--model_name_or_path", MODEL, "--output_dir", ""], "--output_dir"),
        (["eval", "--model_name_or_path", " "], "--model_name_or_path"),
        (["demo", "--output_dir", ""], "--output_dir"),
        (["probe", "--output_file", ""], "--output_file"),
        (["probe", "--out", ""], "--output_file"),  # the old spelling, renamed first
        (["pretrain", "--output-dir", ""], "--output_dir"),  # a Path field: '' became Path('.')
        (["compare", "--runs", "evals/a", "", "--baseline", "a"], "--runs"),
    ],
)
def test_an_empty_path_flag_is_an_error_naming_it(argv, flag) -> None:
    """`--output_dir $OUT` with OUT unset passes '': it meant the current folder (or the default)."""
    from ncgrpo.cli import build_parser
    from ncgrpo.commands.config_file import ConfigError

    with pytest.raises(
        ConfigError, match=rf"^{flag} (is empty|holds an empty path) \(.*an unset shell variable\?\)"
    ):
        build_parser().parse_args(argv)


def test_an_empty_path_in_a_config_file_names_the_file_and_key(tmp_path) -> None:
    from ncgrpo.cli import build_parser
    from ncgrpo.commands.config_file import ConfigError

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {TINY_RECIPE}\noutput_dir: ''\n")
    with pytest.raises(ConfigError, match=rf"^{cfg}: 'output_dir' is empty \(''\)"):
        build_parser().parse_args(["train", "--config", str(cfg)])
    with pytest.raises(ConfigError, match=r"^--config is empty"):
        build_parser().parse_args(["train", "--config", ""])
    assert build_parser().parse_args(["pretrain", "--output_dir", "."]).parsed_config.get(
        "output_dir"
    ) == Path(".")


def test_train_with_an_empty_output_dir_writes_nothing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(_train("", "--dry-run")) == 2  # --output_dir ""
    assert "ncgrpo train: error: --output_dir is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------- sigma0 within what the method can use
@pytest.mark.parametrize("sigma0", [1e30, 3e38, 10.5])
def test_sigma0_above_the_bound_is_refused_with_the_reason(tmp_path, sigma0) -> None:
    """1e30 trained (logged rel_perturbation 1e30), 3e38 ended in an internal error."""
    with pytest.raises(
        ValueError,
        match=rf"sigma0 must be at most 10, got {re.escape(repr(sigma0))}: it is the noise's size relative to the state",
    ):
        _cfg(tmp_path, sigma0=sigma0)


def test_sigma0_up_to_the_bound_is_kept(tmp_path) -> None:
    from ncgrpo.trainer.config import SIGMA0_MAX

    assert SIGMA0_MAX == 10.0
    assert _cfg(tmp_path, sigma0=10.0, max_steps=100).sigma0 == 10.0
    assert _cfg(tmp_path, sigma0=8, max_steps=100).sigma0 == 8  # what the tiny-model tests use


def test_train_refuses_sigma0_1e30_before_writing(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert main(_train(out, "--dry-run", "--sigma0", "1e30")) == 2
    assert "sigma0 must be at most 10, got 1e+30" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "cls"),
    [
        (["probe", "--sigma0", "0", "0.2", "1e30"], "ncgrpo.commands.probe:ProbeArgs"),
        (["demo", "--sigma0", "0.2", "3e38"], "ncgrpo.toy.demo_config:DemoConfig"),
    ],
)
def test_probe_and_demo_bound_their_sigma0_lists(argv, cls) -> None:
    import importlib

    from ncgrpo.cli import build_parser
    from ncgrpo.commands._common import UsageError

    module, name = cls.split(":")
    parsed = build_parser().parse_args(argv).parsed_config
    with pytest.raises((ValueError, UsageError), match=r"sigma0: every noise scale must be at most 10, got"):
        parsed.build(getattr(importlib.import_module(module), name))


# ------------------------------------------------------------------------ cryptic messages
def test_a_dangling_link_as_output_dir_names_the_link_and_its_target(tmp_path, capsys) -> None:
    """It said "[Errno 17] File exists: 'dl'"."""
    link = tmp_path / "dl"
    link.symlink_to(tmp_path / "gone")
    assert main(_train(link, "--dry-run")) == 2
    err = capsys.readouterr().err
    assert (
        f"--output_dir {link}: {link} is a link to {tmp_path / 'gone'}, which does not exist; remove the link"
        in err
    )
    assert "File exists" not in err and not (tmp_path / "gone").exists() and link.is_symlink()


def test_a_dangling_link_above_a_path_is_named_too(tmp_path, monkeypatch) -> None:
    from ncgrpo.cli import build_parser
    from ncgrpo.commands.config_file import ConfigError

    monkeypatch.chdir(tmp_path)
    Path("dl").symlink_to("../gone")  # relative: shown as written and resolved
    with pytest.raises(
        ConfigError,
        match=rf"^--output_dir dl/x: dl is a link to \.\./gone \({re.escape(str(tmp_path.parent / 'gone'))}\), which does not exist",
    ):
        build_parser().parse_args(["pretrain", "--output_dir", "dl/x"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("output_dir: dl\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(cfg))}: 'output_dir' dl: dl is a link to"):
        build_parser().parse_args(["pretrain", "--config", str(cfg)])
    Path("ok").symlink_to(tmp_path)  # a link that resolves is a path like any other
    assert build_parser().parse_args(["pretrain", "--output_dir", "ok/x"]).parsed_config.get(
        "output_dir"
    ) == Path("ok/x")


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "a/b/c", "~/no-such-model-35"])
def test_check_model_source_says_a_missing_path_does_not_exist(tmp_path, name) -> None:
    """transformers takes a missing path for a hub id and answers "Repo id must be in the form ..."."""
    from ncgrpo.models import check_model_source

    with pytest.raises(
        ValueError, match=rf"^--model_name_or_path {re.escape(name)}: .* does not exist; pass a folder"
    ):
        check_model_source(name)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_model_source(tmp_path / "f", "model_name_or_path")
    with pytest.raises(ValueError, match="holds no config.json"):
        check_model_source(tmp_path)
    check_model_source(tmp_path, contents=False)  # eval: adapter folders and runs too; its loader says more
    check_model_source(MODEL)


def test_check_model_source_offline_hub_id_not_cached(monkeypatch) -> None:
    from huggingface_hub import constants

    from ncgrpo.models import check_model_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ValueError,
        match=r"no-such-org-35/no-such-model: no local folder .* \(it does not exist\), and not in the hub cache",
    ):
        check_model_source("no-such-org-35/no-such-model")


def test_eval_says_a_missing_model_does_not_exist_before_writing(tmp_path, capsys) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text('{"question_id": "q1", "question": "What is 1+1?", "answer": "2"}\n')
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model_name_or_path",
                str(tmp_path / "nope"),
                "--data",
                f"mine={data}",
                "--output_dir",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"--model_name_or_path {tmp_path / 'nope'}: {tmp_path / 'nope'} does not exist" in err, err
    assert "repo id" not in err.lower() and not out.exists()
