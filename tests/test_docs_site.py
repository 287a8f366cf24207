"""The documentation site: the settings reference is generated from ``NCGRPOConfig`` and lists every
NC-GRPO field under a topic header; the site builds with warnings as errors and its pages list what
they must (the settings page and the API page of ``NCGRPOConfig`` every field; the API pages the
public functions users call)."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trl import GRPOConfig

from ncgrpo.trainer import NCGRPOConfig

ROOT = Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_settings", ROOT / "docs" / "gen_settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _own_fields() -> list[str]:
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f.name for f in dataclasses.fields(NCGRPOConfig) if f.name not in inherited]


def test_committed_settings_reference_is_what_the_code_generates() -> None:
    """docs/reference/settings.md is committed (it reads on GitHub; links to it resolve in the checkout)
    and must be regenerated when a field or its help changes: `python docs/gen_settings.py --write`."""
    gen = _gen()
    assert gen.stale() is None, gen.stale()
    page = (ROOT / "docs" / "reference" / "settings.md").read_text(encoding="utf-8")
    for name in _own_fields():
        assert f"#### `{name}`" in page, name


def test_generated_reference_lists_every_field_under_a_group() -> None:
    gen = _gen()
    assert gen.nc_grpo_fields() == _own_fields() and len(_own_fields()) >= 25
    page = gen.render()
    group_of = {}
    group = None
    for line in page.splitlines():
        if line.startswith("### ") and not line.startswith("### `"):
            group = line[4:]
        elif line.startswith("## "):
            group = None
        elif m := re.match(r"#### `(\w+)`$", line):
            group_of[m.group(1)] = group
    for name in _own_fields():
        assert group_of.get(name), f"{name} is not under a group header of the settings reference"
        help_start = NCGRPOConfig.__dataclass_fields__[name].metadata["help"][:20]
        assert gen._text(help_start)[:10] in page, name
    assert {g for g in group_of.values()} == {
        t.replace("NC-GRPO: ", "").capitalize() for t in NCGRPOConfig.help_groups
    }
    # the six fields docs/library.md's hand-written list had missed are there
    for name in (
        "branch_prefix",
        "noise_positions",
        "share_prompt_prefill",
        "share_prompt_loss",
        "noise_seed",
        "spsa_max_step_ratio",
    ):
        assert f"#### `{name}`" in page


def test_a_field_in_no_group_fails_the_generation(monkeypatch) -> None:
    groups = dict(NCGRPOConfig.help_groups)
    groups["NC-GRPO: noise"] = tuple(n for n in groups["NC-GRPO: noise"] if n != "noise_seed")
    monkeypatch.setattr(NCGRPOConfig, "help_groups", groups)
    with pytest.raises(RuntimeError, match="noise_seed"):
        _gen().render()


def test_help_text_is_escaped_for_markdown() -> None:
    assert _gen()._text("'<think>' a_b * c") == "'&lt;think&gt;' a\\_b \\* c"


#: the objects the API reference must document (issue 33): page -> mkdocstrings anchors
API = {
    "reference/api/trainer": ["ncgrpo.trainer.NCGRPOConfig", "ncgrpo.trainer.NCGRPOTrainer"],
    "reference/api/rollouts": [
        "ncgrpo.rollout.generate_groups",
        "ncgrpo.engines.transformers.prefill_noise",
    ],
    "reference/api/eval": [
        "ncgrpo.eval.evaluate.evaluate",
        "ncgrpo.eval.evaluate.DecodingSettings",
        "ncgrpo.data.types.Question",
        "ncgrpo.eval.stats.mcnemar_exact",
    ],
    "reference/api/probe": ["ncgrpo.eval.probe.probe", "ncgrpo.eval.probe_result.ProbeResult"],
    "reference/api/rewards": ["ncgrpo.rewards.make_math_reward", "ncgrpo.rewards.grade"],
    "reference/api/core": [
        "ncgrpo.core.noise.perturb",
        "ncgrpo.core.schedule.sigma_schedule",
        "ncgrpo.core.plan.plan_group",
    ],
}


@pytest.mark.slow
def test_site_builds_strict_and_lists_every_setting(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists() or shutil.which(str(mkdocs)) is None:
        if os.environ.get("NCGRPO_REQUIRE_DOCS"):
            pytest.fail(f"{mkdocs} is missing: install the docs extra (pip install -e '.[docs]')")
        pytest.skip("the docs extra is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    settings = (site / "reference" / "settings.html").read_text(encoding="utf-8")
    api = (site / "reference" / "api" / "trainer.html").read_text(encoding="utf-8")
    for name in _own_fields():
        assert f'id="{name}"' in settings, f"settings page has no entry for {name}"
        assert f'<td id="ncgrpo.trainer.NCGRPOConfig.{name}"><code>{name}</code></td>' in api, name
    # the fields as a table, not as the source of their field(default=..., metadata=...) calls
    assert 'class="ncgrpo-fields"' in api and "metadata" not in api
    for page, anchors in API.items():
        html = (site / f"{page}.html").read_text(encoding="utf-8")
        for anchor in anchors:
            assert f'id="{anchor}"' in html, f"{page} does not document {anchor}"
    # read from disk (issue 44): pages are page.html and links name them (a folder link opens a listing
    # from file://), search reads its index from a script, the file:// worker shim is the site's own
    guide = (site / "guides" / "own-model-and-data.html").read_text(encoding="utf-8")
    links = re.findall(r'href="([^"#:]+)"', guide)
    assert links and not [x for x in links if x.endswith("/")], [x for x in links if x.endswith("/")]
    assert '"../evaluation.html"' not in guide and 'href="evaluation.html"' in guide
    assert (site / "search" / "search_index.js").read_text(encoding="utf-8").startswith("var __index = ")
    assert '<script src="../javascripts/iframe-worker-shim.js"' in guide and "unpkg.com" not in guide
    # the guide's code is on the page, and code blocks wrap
    assert "NCGRPOTrainer" in guide and "last_number_reward" in guide and "<code>" in guide
    assert 'href="../stylesheets/extra.css"' in guide
    assert "white-space: pre-wrap" in (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")


def test_config_fields_render_as_a_table_of_name_type_default_and_help() -> None:
    """The API page's NCGRPOConfig fields (issue 44: mkdocstrings showed each as the source of its
    field(default=..., metadata={"help": ...}) call in a horizontal scroller)."""
    table = _gen().fields_table("ncgrpo.trainer.NCGRPOConfig")
    for name in _own_fields():
        f = NCGRPOConfig.__dataclass_fields__[name]
        row = next(line for line in table.splitlines() if f'id="ncgrpo.trainer.NCGRPOConfig.{name}"' in line)
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        assert len(cells) == 4 and cells[0] == f"<code>{name}</code>", row
        if f.default is not dataclasses.MISSING:
            assert cells[2] == f"<code>{html.escape(repr(f.default))}</code>", row
        assert cells[3] and "(no help text)" not in cells[3], row
    assert "<th>Name</th><th>Type</th><th>Default</th><th>Help</th>" in table
    assert "metadata" not in table and "field(" not in table
    row = next(line for line in table.splitlines() if "NCGRPOConfig.target_marginal_tv" in line)
    assert (
        "<code>float | None</code>" in row
        and "<code>None</code>" in row
        and "<code>ncgrpo probe</code>" in row
    )
    page = "text\n<!-- ncgrpo-fields: ncgrpo.trainer.NCGRPOConfig -->\nmore"
    assert _gen().on_page_markdown(page, None, None, None) == f"text\n{table}\nmore"


def _hooks():
    spec = importlib.util.spec_from_file_location("gen_hooks", ROOT / "docs" / "gen_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_links_out_of_docs_become_repository_paths() -> None:
    rewrite = _hooks().repo_links_as_paths
    docs = ROOT / "docs"
    page = (
        "see [recipes/README.md](../recipes/README.md#trying-a-recipe-small), [the recipes](../recipes/README.md), "
        "[eq](equations.md#x), [up](../../elsewhere.md), [web](https://example.org/a.md)\n"
        "```\n[kept](../recipes/README.md)\n```"
    )
    out = rewrite(page, "x.md", docs, ROOT)
    assert out.splitlines()[0] == (
        "see `recipes/README.md`, the recipes (`recipes/README.md`), [eq](equations.md#x), "
        "[up](../../elsewhere.md), [web](https://example.org/a.md)"
    )
    assert "[kept](../recipes/README.md)" in out  # code blocks are left alone
    # a page one folder down resolves its links from there
    assert (
        rewrite("[r](../../src/ncgrpo/config.py)", "guides/x.md", docs, ROOT) == "r (`src/ncgrpo/config.py`)"
    )


def test_sphinx_roles_are_dropped_from_rendered_docstrings() -> None:
    clean = _hooks().clean_roles
    assert clean("a :func:<code>~ncgrpo.core.noise.perturb</code> b") == "a <code>perturb</code> b"
    assert (
        clean(":class:<code>ncgrpo.trainer.NCGRPOConfig</code>") == "<code>ncgrpo.trainer.NCGRPOConfig</code>"
    )
