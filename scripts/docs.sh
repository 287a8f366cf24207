#!/usr/bin/env bash
# Build the documentation site into site/ with warnings as errors (mkdocs.yml: a broken link, a missing
# page or anchor, or an API reference that does not resolve fails the build); open site/index.html from
# disk (links and search work from file://). `bash scripts/docs.sh --serve` previews it on
# http://127.0.0.1:8000 instead. Needs the docs extra in .venv: .venv/bin/pip install -e ".[docs]"
set -euo pipefail
cd "$(dirname "$0")/.."
MKDOCS=.venv/bin/mkdocs
if [ ! -x "$MKDOCS" ]; then
  echo "docs: $MKDOCS not found; install the docs extra: .venv/bin/pip install -e \".[docs]\"" >&2
  exit 2
fi
export NO_MKDOCS_2_WARNING=1  # Material's banner about MkDocs 2, printed at every build
if [ "${1:-build}" = "--serve" ] || [ "${1:-build}" = "serve" ]; then
  shift
  exec "$MKDOCS" serve --strict "$@"
fi
"$MKDOCS" build --strict "$@"
echo "docs: built; open index.html of the site folder (site/ unless --site-dir) from disk, or run bash scripts/docs.sh --serve" >&2
