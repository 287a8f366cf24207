"""One name per concept on every command: ``ncgrpo train|eval|probe|demo --help`` spell each shared
setting the way ``ncgrpo train`` does (read from the parsers themselves), and the old spellings still
parse, with a deprecation message, for one release."""

from __future__ import annotations

import argparse

import pytest

from ncgrpo.cli import build_parser, main
from ncgrpo.commands.config_file import NEGATED, RENAMED

COMMANDS = ("train", "eval", "probe", "demo", "pretrain", "compare", "plot gains", "plot dynamics")

#: setting -> the commands that have it (each must spell it this way)
SHARED = {
    "model_name_or_path": ("train", "eval", "probe", "demo"),
    "output_dir": ("train", "eval", "demo", "pretrain", "compare", "plot gains", "plot dynamics"),
    "sigma0": ("train", "probe", "demo"),
    "noise_site": ("train", "probe", "demo"),
    "noise_layer_decay": ("train", "probe"),
    "max_steps": ("train", "demo"),
    "rollout_method": ("train", "eval", "probe"),
    "max_completion_length": ("train", "probe", "demo"),
    "branch_prefix": ("train", "probe", "demo"),
    "num_threads": ("probe", "demo"),
    "progress": ("eval", "probe", "demo"),
    "seed": ("train", "eval", "probe"),
}


def _flags(command: str) -> set[str]:
    """The options ``ncgrpo COMMAND --help`` lists, as field-style names (``--noise-site`` -> noise_site)."""
    sub = build_parser()
    for word in command.split():  # "plot gains": a subcommand of a subcommand
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    sub.format_help()  # builds the dataclass options of a lazily-configured command
    return {
        opt.lstrip("-").replace("-", "_")
        for action in sub._actions
        if action.help is not argparse.SUPPRESS
        for opt in action.option_strings
        if opt.startswith("--")
    }


@pytest.fixture(scope="module")
def flags() -> dict[str, set[str]]:
    return {c: _flags(c) for c in COMMANDS}


def test_the_same_setting_has_the_same_name_on_every_command(flags) -> None:
    missing = [f"ncgrpo {c} --{name}" for name, cs in SHARED.items() for c in cs if name not in flags[c]]
    assert not missing, f"not spelled as ncgrpo train spells it: {missing}"


def test_no_command_offers_an_old_spelling(flags) -> None:
    # --no_progress is the negative form of the boolean --progress, not a setting of its own; and
    # max_new_tokens is the evaluation budget where a command has one (eval, demo): only the probe's
    # rollout budget was misnamed so
    names = [o for o in [*RENAMED, *NEGATED] if o not in ("no_progress", "max_new_tokens")]
    old = [f"ncgrpo {c} --{o}" for c in COMMANDS for o in names if o in flags[c]]
    assert "max_new_tokens" not in flags["probe"]
    assert not old, f"old spellings listed in --help: {old}"


def test_old_spellings_parse_with_a_deprecation_message(monkeypatch, tmp_path, capsys) -> None:
    seen = {}

    def stop(args):
        seen["args"] = args
        raise ValueError("stop here")

    import ncgrpo.commands.probe as probe_command

    monkeypatch.setattr(probe_command, "run", stop)
    model = tmp_path / "m"  # the probe checks a model folder exists before anything else
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["probe", "--sigma", "0.1", "0.3", "--site", "1", "--layer_decay", "0.25", "--method", "antithetic",
            "--threads", "2", "--max_new_tokens", "9", "--model", str(model), "--out", str(tmp_path / "p.json")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "stop here" in err
    for old, new in [("sigma", "sigma0"), ("site", "noise_site"), ("layer_decay", "noise_layer_decay"),
                     ("method", "rollout_method"), ("threads", "num_threads"),
                     ("max_new_tokens", "max_completion_length"), ("model", "model_name_or_path"),
                     ("out", "output_file")]:  # fmt: skip
        assert f"--{old} is deprecated and will be removed in ncgrpo 0.2.0; use --{new}" in err
    a = seen["args"]
    assert (a.sigma0, a.noise_site, a.noise_layer_decay, a.rollout_method) == (
        [0.1, 0.3],
        "1",
        0.25,
        "antithetic",
    )
    assert (a.num_threads, a.max_completion_length, a.model_name_or_path) == (2, 9, str(model))
    assert str(a.output_file) == str(tmp_path / "p.json")

    # a config file's old keys, and the old negative boolean key
    conf = tmp_path / "eval.yaml"
    conf.write_text("model: /m\nout: o\nno_progress: true\nmethod: latent\nbenchmarks: [geo3k]\n")
    import ncgrpo.commands.eval as eval_command

    monkeypatch.setattr(eval_command, "run", stop)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--config", str(conf)]) == 2
    err = capsys.readouterr().err
    for old, new in [("model", "model_name_or_path"), ("out", "output_dir"), ("no_progress", "progress"),
                     ("method", "rollout_method")]:  # fmt: skip
        assert f"{conf}: key '{old}' is deprecated and will be removed in ncgrpo 0.2.0; use '{new}'" in err


def test_an_old_and_a_new_key_for_one_setting_is_an_error(tmp_path, capsys) -> None:
    conf = tmp_path / "demo.yaml"
    conf.write_text("steps: 3\nmax_steps: 4\n")
    assert main(["demo", "--config", str(conf)]) == 2
    assert "'steps' and 'max_steps' are one setting; keep only 'max_steps'" in capsys.readouterr().err


def test_the_command_line_imports_no_torch_until_a_command_runs() -> None:
    """``ncgrpo --help`` imports every command module; they must stay light (torch and transformers are
    imported by the command that runs)."""
    import subprocess
    import sys

    code = "import sys, ncgrpo.cli; bad = {'torch', 'transformers'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
