#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh here, on a CPU, the way it must run on the lent GPU machine: an
# environment like that machine's (Python 3.12, torch 2.11 from PyPI and the packages it has preinstalled,
# transformers 5.17 among them), then, with the network closed, only the carried wheel folder
# (pip install --no-index) and ncgrpo from this checkout, and the whole plan at tiny scale on the CPU.
# A missing wheel or a wrong pin fails here instead of on the GPU (docs/gpu.md, "Rehearsal").
#
#   scripts/gpu_rehearse.sh [--python PY] [--venv DIR] [--wheels DIR] [--out DIR] [--fresh]
#
#   --python PY   the interpreter of the machine-like venv (default: a Python 3.12 if one is found, as the
#                 GPU machine has; else python3, which the report then names as a deviation)
#   --venv DIR    the machine-like venv (default ${TMPDIR:-/tmp}/ncgrpo-gpu-machine); built once from PyPI
#                 (about 3 GB with torch 2.11's CUDA libraries) and reused while its package list is the same
#   --wheels DIR  the wheel folder (default ${TMPDIR:-/tmp}/ncgrpo-gpu-wheels): scripts/gpu_wheels.sh fills
#                 it for the GPU machine (cp312) and DIR/local for --python
#   --out DIR     the plan's report folder (default ${TMPDIR:-/tmp}/ncgrpo-gpu-rehearsal)
#   --fresh       rebuild the venv even when it is there
# Exit 0 when the plan ran with every part passed or skipped for a stated reason, 1 otherwise, 2 for bad usage.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="gpu_rehearse.sh"
die() { echo "$PROG: error: $*" >&2; exit 2; }

# What the lent machine has preinstalled (KINDS.md of the device tool; pins where a version was read there).
MACHINE_PACKAGES=(
    torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 accelerate==1.15.0 huggingface_hub==1.33.0
    tokenizers==0.23.2 safetensors==0.8.0 pyarrow==25.0.1 fsspec==2026.7.0 peft numpy scipy pandas pillow
    matplotlib rich tqdm pyyaml pytest pytest-timeout hypothesis regex psutil sympy typer xxhash requests
    httpx jinja2 filelock packaging
)

PY="" VENV="${TMPDIR:-/tmp}/ncgrpo-gpu-machine" WHEELS="${TMPDIR:-/tmp}/ncgrpo-gpu-wheels"
OUT="${TMPDIR:-/tmp}/ncgrpo-gpu-rehearsal" FRESH=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || die "--python needs an interpreter"; PY="$2"; shift 2 ;;
        --venv) [ $# -ge 2 ] || die "--venv needs a folder"; VENV="$2"; shift 2 ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS="$2"; shift 2 ;;
        --out) [ $# -ge 2 ] || die "--out needs a folder"; OUT="$2"; shift 2 ;;
        --fresh) FRESH=1; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
# --out is replaced: only an earlier report folder (its report.json) or an empty or missing one, never a
# folder of something else (`--out .`, a results folder named by mistake)
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2> /dev/null)" ] && [ ! -f "$OUT/report.json" ]; then
    die "--out $OUT holds files but no report.json of an earlier rehearsal; name an empty or new folder"
fi
if [ -z "$PY" ]; then
    for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
        if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY="$c"; break; fi
    done
    [ -n "$PY" ] || PY=python3
fi
"$PY" -c 'import sys' 2>/dev/null || die "--python: '$PY' does not run"
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$PYVER" = 3.12 ] || echo "$PROG: note: Python $PYVER, not the GPU machine's 3.12 (a deviation)" >&2

T0=$(date +%s)
stamp() { echo "[$PROG] $(( $(date +%s) - T0 ))s: $*"; }

# 1. the machine-like venv (network: PyPI), reused while its package list is unchanged
WANT="$PYVER ${MACHINE_PACKAGES[*]}"
if [ $FRESH -eq 1 ] || [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.machine-packages" 2>/dev/null)" != "$WANT" ]; then
    stamp "building the machine-like venv $VENV (Python $PYVER; ${MACHINE_PACKAGES[*]})"
    rm -rf -- "$VENV"
    "$PY" -m venv "$VENV" || die "cannot create $VENV"
    "$VENV/bin/python" -m pip install -q "${MACHINE_PACKAGES[@]}" 2>&1 | grep -v "is ignored: it is neither" >&2
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "$PROG: error: installing the machine's packages failed" >&2; exit 1; }
    echo "$WANT" > "$VENV/.machine-packages"
fi
# the machine has neither these nor ncgrpo: the rehearsal must bring them
for m in trl datasets math_verify ncgrpo; do
    if "$VENV/bin/python" -c "import $m" 2>/dev/null; then
        echo "$PROG: error: $VENV already has $m; the rehearsal would not test the wheels (use --fresh)" >&2
        exit 1
    fi
done
stamp "machine-like venv ready: $("$VENV/bin/python" -c 'import sys, torch, transformers; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__} (preinstalled)")')"

# 2. the wheel folder (network: PyPI): the GPU machine's set, and the same pins for this interpreter
bash "$ROOT/scripts/gpu_wheels.sh" "$WHEELS" --local-python "$VENV/bin/python" "$WHEELS/local" || exit 1
stamp "wheels ready"

# 3. the plan with the network closed: pip reads no config (no index, no find-links), an index and proxies
# that point nowhere, the hub offline; only the local wheel folder and the checkout are used
rm -rf -- "$OUT"
T1=$(date +%s)
env PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS= PIP_INDEX_URL=http://127.0.0.1:9/simple \
    PIP_EXTRA_INDEX_URL= HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 \
    http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 NO_PROXY= no_proxy= \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    bash "$ROOT/scripts/gpu_check.sh" "$OUT" --python "$VENV/bin/python" --wheels "$WHEELS/local" \
    --device cpu --scale tiny --work "$OUT.work"
rc=$?
T2=$(date +%s)
stamp "plan finished (exit $rc) in $((T2 - T1))s; report: $OUT/report.md"
echo "$PROG: rehearsal $( [ $rc -eq 0 ] && echo passed || echo FAILED ): install + plan $((T2 - T1))s, total $((T2 - T0))s (Python $PYVER, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
exit $rc
