#!/usr/bin/env bash
# Create .venv and install ncgrpo with its dev extras. Idempotent: rerunning it is cheap.
#
# torch is installed first, on its own, so that the rest of the install never pulls a torch build
# you did not choose:
#   - NCGRPO_TORCH_SPEC set (e.g. "torch==2.9.1" or "torch --index-url ..."): that is used;
#   - torch already importable in .venv: kept;
#   - a local CPU wheel in pip's find-links folder (PIP_FIND_LINKS, e.g. an offline CPU box): that exact
#     version is pinned, so pip takes the local wheel instead of downloading a multi-GB CUDA build;
#   - otherwise: "torch>=2.6", pip's default build for this platform.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade "pip>=24" 2>&1 | grep -v "^WARNING: Location" || true

spec=${NCGRPO_TORCH_SPEC:-}
if [ -z "$spec" ] && ! "$VPY" -c "import torch" 2>/dev/null; then
  wheel=""
  for d in ${PIP_FIND_LINKS:-}; do
    w=$(ls "$d"/torch-*+cpu-*.whl 2>/dev/null | head -n 1 || true)
    [ -n "$w" ] && wheel=$w && break
  done
  if [ -n "$wheel" ]; then
    v=$(basename "$wheel" | cut -d- -f2)
    spec="torch==${v%%+*}"
  else
    spec="torch>=2.6"
  fi
fi
if [ -n "$spec" ]; then
  echo "setup: installing $spec"
  # shellcheck disable=SC2086
  "$VPY" -m pip install -q $spec 2>&1 | grep -v "^WARNING: Location" || true
  "$VPY" -c "import torch" || { echo "setup: torch failed to install ($spec)" >&2; exit 1; }
fi
"$VPY" -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
"$VPY" -c "import ncgrpo, torch, transformers, trl; print(f'setup: ncgrpo {ncgrpo.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}')"
