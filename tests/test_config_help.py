"""``ncgrpo train --help`` lists NC-GRPO's settings first, under their topic headers
(``NCGRPOConfig.help_groups`` read by :class:`ncgrpo.commands.parser.ConfigParser`), with a usage line that
names the command's own flags instead of every field."""

from __future__ import annotations

import dataclasses
import re

import pytest
from trl import GRPOConfig

from ncgrpo.cli import main
from ncgrpo.commands.parser import ConfigParser
from ncgrpo.trainer import NCGRPOConfig


def _train_help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_nc_grpo_settings_come_first_under_their_headers(capsys) -> None:
    text = _train_help(capsys)
    lines = text.splitlines()
    headers = [  # argparse's group headers: "title:" at column 0, then an option line
        i
        for i, line in enumerate(lines[:-1])
        if re.match(r"^\S.*:$", line) and lines[i + 1].startswith("  -")
    ]
    titles = [lines[i][:-1] for i in headers]
    groups = list(NCGRPOConfig.help_groups)
    # the topic groups are the first headers, in order, before "options" and TRL's inherited fields
    assert titles[: len(groups)] == groups, titles
    assert titles.index("options") == len(groups)
    assert titles[-1] == NCGRPOConfig.help_rest_title
    # each NC-GRPO field sits under its own header, within the first tenth of the help
    for title, members in NCGRPOConfig.help_groups.items():
        start = headers[titles.index(title)]
        end = next(h for h in headers if h > start)
        block = "\n".join(lines[start:end])
        for name in members:
            assert f"--{name} " in block or f"--{name}\n" in block, (title, name)
    first_trl = text.index("--learning_rate ")
    assert all(text.index(f"--{n} ") < first_trl for n in NCGRPOConfig.help_groups["NC-GRPO: noise"])
    assert "--learning_rate " in "\n".join(lines[headers[-1] :])
    # the usage names the command's flags, not the ~400 fields
    usage = text.split("\n\n", 1)[0]
    assert usage.startswith("usage: ncgrpo train ") and "--resume" in usage and "--SETTING VALUE" in usage
    assert "--learning_rate" not in usage and len(usage.splitlines()) < 5


def test_every_nc_grpo_field_is_in_one_help_group() -> None:
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    own = [f.name for f in dataclasses.fields(NCGRPOConfig) if f.name not in inherited]
    grouped = [name for members in NCGRPOConfig.help_groups.values() for name in members]
    assert sorted(grouped) == sorted(set(grouped)), "a field is in two groups"
    assert set(own) - set(grouped) == set(), "NCGRPOConfig fields missing from help_groups"
    assert set(grouped) <= {f.name for f in dataclasses.fields(NCGRPOConfig)}


def test_help_groups_naming_no_field_is_an_error() -> None:
    @dataclasses.dataclass
    class Bad:
        a: int = dataclasses.field(default=1, metadata={"help": "a"})
        help_groups = {"topic": ("a", "b")}

    with pytest.raises(ValueError, match=r"help_groups\['topic'\] names no field b"):
        ConfigParser([Bad])


def test_a_dataclass_without_groups_parses_and_prints_as_before() -> None:
    @dataclasses.dataclass
    class Plain:
        alpha: int = dataclasses.field(default=1, metadata={"help": "the alpha"})

    parser = ConfigParser([Plain], prog="x")
    (cfg,) = parser.parse_args_and_config(["--alpha", "3"])
    assert cfg.alpha == 3
    text = parser.format_help()
    assert text.startswith("usage: x [-h] [--config YAML] [--SETTING VALUE]")
    assert "options:" in text and "--alpha ALPHA" in text
