"""No document in the repository points at a file or folder the repository does not hold: every
relative Markdown link in a ``*.md`` file resolves (its ``#anchor`` too, for links to Markdown
headings), every repository path cited in a ``*.md`` file or a recipe (``docs/...``, ``recipes/...``,
``src/...``, ``tests/...``, ``scripts/...``, ``benchmarks/...``, ``examples/...``; globs must match
something) exists, and nothing cites the project brief's folders outside the checkout (``shared/paper``,
``shared/reference``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("docs", "recipes", "src", "tests", "scripts", "benchmarks", "examples", ".ci")
#: a cited path: one of the prefixes, then path characters (globs allowed), not inside a longer path
PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(map(re.escape, PREFIXES)) + r")/[\w.*/-]*[\w*/])")
#: a placeholder the reader replaces (`recipes/RECIPE.yaml`, `docs/NAME.md`): all capitals
PLACEHOLDER = re.compile(r"(?:^|/)(?!README|CHANGELOG|LICENSE|CITATION)[A-Z][A-Z0-9_]*(?:\.\w+)?(?:/|$)")
#: pages the site generates at build time (docs/gen_settings.py), which links may name
GENERATED: set = set()  # every page is committed (docs/reference/settings.md is held fresh by test_docs_site)
#: the project brief's folders, which live next to the checkout, not in it
OUTSIDE = re.compile(r"(?<![\w/.-])(?:\.\./)?shared/(?:paper|reference)\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md", "recipes/*.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted(ROOT / p for p in listed if (ROOT / p).is_file())


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (MkDocs) gives a heading (GitHub's, for these)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(md: Path) -> set[str]:
    out = set()
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            out.add(_slug(m.group(1)))
    return out


def _exists(cited: str) -> bool:
    cited = cited.rstrip(".")
    if PLACEHOLDER.search(cited) or ROOT / cited in GENERATED:
        return True
    if any(c in cited for c in "*?["):
        return any(ROOT.glob(cited))
    return (ROOT / cited).exists()


def _problems(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    text = path.read_text(encoding="utf-8")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{rel}:{n}"
        if OUTSIDE.search(line):
            out.append(f"{where}: cites {OUTSIDE.search(line).group(0)!r}, a folder outside the repository")
        for cited in PATH.findall(line):
            if not _exists(cited):
                out.append(f"{where}: cites {cited}, which the repository does not hold")
        if path.suffix != ".md":
            continue
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
                continue  # a URL (http:, mailto:) or a site-absolute path
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if dest in GENERATED:
                continue
            if not dest.exists():
                out.append(f"{where}: link to {target}: {file_part} does not exist")
            elif not dest.resolve().is_relative_to(ROOT):
                out.append(f"{where}: link to {target} leaves the repository")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                out.append(f"{where}: link to {target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    return out


def test_the_scan_covers_the_documents() -> None:
    names = {str(p.relative_to(ROOT)) for p in _files()}
    assert {"README.md", "docs/equations.md", "recipes/README.md"} <= names
    assert any(n.startswith("recipes/") and n.endswith(".yaml") for n in names)


@pytest.mark.parametrize(
    "text, bad",
    [
        ("see `docs/nope.md`", "docs/nope.md"),
        ("[x](nope.md)", "nope.md"),
        ("[x](docs/equations.md#no-such-heading)", "no-such-heading"),
        ("the paper (`shared/paper/`)", "shared/paper"),
        ("# from ../shared/reference/anchors.md", "shared/reference"),
        ("`recipes/*_nothing.yaml`", "recipes/*_nothing.yaml"),
        ("`docs/README.md`", "docs/README.md"),
    ],
)
def test_a_missing_path_is_reported(tmp_path: Path, text: str, bad: str, monkeypatch) -> None:
    doc = ROOT / "docs" / "_probe_doc_paths.md"
    doc.write_text(text + "\n", encoding="utf-8")
    try:
        problems = _problems(doc)
    finally:
        doc.unlink()
    assert len(problems) == 1 and bad in problems[0], problems


def test_existing_paths_pass() -> None:
    doc = ROOT / "docs" / "_probe_doc_paths_ok.md"
    doc.write_text(
        "`docs/equations.md`, [eq](equations.md#section-31-noise-induced-branching), `recipes/*.yaml`, "
        "`tests/test_doc_paths.py::x`, `/shared/runs/x` (an absolute user path), [site](https://example.org/x), "
        "`recipes/RECIPE.yaml` (a placeholder), [settings](reference/settings.md)\n",
        encoding="utf-8",
    )
    try:
        assert _problems(doc) == []
    finally:
        doc.unlink()


def test_no_document_cites_a_path_the_repository_does_not_hold() -> None:
    problems = [p for f in _files() for p in _problems(f)]
    assert not problems, "\n".join(problems)
