"""Issue 26, item 8: ``env:`` values in a config are set as written (the way a shell reads
``NAME=value``), null / lists / mappings are errors naming the file and key, and the resolved
``config.yaml`` keeps the ``env:`` block so rerunning from it restores the environment. Also the
``base: <a folder>`` message (was ``[Errno 21]`` without the including file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ncgrpo.cli import main
from ncgrpo.commands.config_file import ConfigError, load_config_file

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu_latent.yaml"


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("NCG_A", "NCG_B", "NCG_C", "NCG_D", "NCG_E", "NCG_F"):
        monkeypatch.delenv(k, raising=False)


def test_env_values_are_set_as_written(tmp_path: Path, clean_env) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        'env:\n  NCG_A: no\n  NCG_B: 1.0\n  NCG_C: true\n  NCG_D: 0x10\n  NCG_E: "x y"\n  NCG_F: ""\n'
    )
    loaded = load_config_file(f)
    want = {"NCG_A": "no", "NCG_B": "1.0", "NCG_C": "true", "NCG_D": "0x10", "NCG_E": "x y", "NCG_F": ""}
    assert loaded.env == want
    assert {k: os.environ[k] for k in want} == want


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("null", r"env: 'NCG_A' is null"),
        ("~", r"env: 'NCG_A' is null"),
        ("", r"env: 'NCG_A' is null"),
        ("{a: 1}", r"env: 'NCG_A' is a mapping"),
        ("[1, 2]", r"env: 'NCG_A' is a list"),
    ],
)
def test_env_values_that_are_not_one_string_are_errors(tmp_path: Path, clean_env, value, match) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"env:\n  NCG_A: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{f}: {match}"):
        load_config_file(f)
    assert "NCG_A" not in os.environ


def test_env_must_be_a_mapping(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("env: [A]\n")
    with pytest.raises(ConfigError, match="'env' must be a mapping"):
        load_config_file(f)


def test_the_resolved_config_keeps_env_and_a_rerun_from_it_restores_it(tmp_path: Path, clean_env) -> None:
    """A base's env and the recipe's own (the recipe wins), through ncgrpo train --dry-run."""
    from test_train_cli import write_geo3k_parquet

    data = write_geo3k_parquet(tmp_path / "geo3k")
    (tmp_path / "base.yaml").write_text(f"base: {TINY_RECIPE}\nenv:\n  NCG_A: no\n  NCG_B: from-base\n")
    (tmp_path / "r.yaml").write_text("base: base.yaml\nenv:\n  NCG_B: 2.50\n")
    out = tmp_path / "run"
    flags = [
        "--dataset_name",
        "geo3k",
        "--dataset_path",
        str(data),
        "--model_name_or_path",
        str(ROOT / "src" / "ncgrpo" / "toy" / "assets" / "base"),  # a dry run reads the model's config
        "--dry-run",
    ]
    assert main(["train", "--config", str(tmp_path / "r.yaml"), "--output_dir", str(out), *flags]) == 0
    resolved = out / "config.yaml"
    import yaml

    assert yaml.safe_load(resolved.read_text())["env"] == {"NCG_A": "no", "NCG_B": "2.50"}
    for k in ("NCG_A", "NCG_B"):
        del os.environ[k]
    again = tmp_path / "again"
    assert main(["train", "--config", str(resolved), "--output_dir", str(again), *flags]) == 0
    assert (os.environ["NCG_A"], os.environ["NCG_B"]) == ("no", "2.50")


def test_a_base_or_config_that_is_a_folder_names_the_including_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "dir").mkdir()
    f = tmp_path / "r.yaml"
    f.write_text("base: dir\n")
    with pytest.raises(
        ConfigError, match=rf"^{f.resolve()}: base {tmp_path / 'dir'} is a folder; 'base' names a YAML file"
    ):
        load_config_file(f)
    assert main(["train", "--config", str(tmp_path / "dir")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'dir'}: is a folder; --config takes a YAML file" in err and "Errno" not in err
