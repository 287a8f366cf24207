"""MkDocs hooks for pages written to be read on GitHub as well as on the site.

* Links from a page in ``docs/`` to a repository file outside ``docs/`` (``../recipes/README.md``,
  ``../src/ncgrpo/...``) have no page on the site: they become the repository path in code
  (``recipes/README.md``), so the strict build still fails on every other broken link. Whether those
  files exist is checked by tests/test_doc_paths.py.
* The code's docstrings are written for Sphinx (``:func:`~ncgrpo.core.noise.perturb```); mkdocstrings
  renders the role as text before the code span. The role name is dropped and, as Sphinx does for
  ``~``, only the last component of the dotted name is shown (``perturb``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj):<code>(~?)([^<]*)</code>")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def clean_roles(html: str) -> str:
    def code(m: re.Match) -> str:
        name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
        return f"<code>{name}</code>"

    return ROLE.sub(code, html)


def repo_links_as_paths(markdown: str, page_path: str, docs_dir: Path, root: Path) -> str:
    """``[text](../x/y.md#a)`` on the page ``page_path`` (relative to ``docs_dir``) -> ``text (`x/y.md`)``
    where the target is in ``root`` but not in ``docs_dir``; other links are left as they are."""

    def rewrite(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return m.group(0)
        resolved = (docs_dir / posixpath.dirname(page_path) / target).resolve()
        if resolved.is_relative_to(docs_dir.resolve()) or not resolved.is_relative_to(root.resolve()):
            return m.group(0)
        path = resolved.relative_to(root.resolve()).as_posix()
        return f"`{path}`" if text.strip("`") == path else f"{text} (`{path}`)"

    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(rewrite, line))
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001 (MkDocs' hook signature)
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    return repo_links_as_paths(markdown, page.file.src_uri, docs_dir, root)


def on_page_content(html, page, config, files):  # noqa: ANN001
    return clean_roles(html)
