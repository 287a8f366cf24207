#!/usr/bin/env bash
# One command for a fresh GPU machine: the gpu-marked tests, the vLLM rollout benchmark at a
# Qwen2.5-VL-3B width (random weights; vanilla vs NC-GRPO), and a 3-step NC-GRPO training run with the
# 7B recipe's settings scaled to that model on vLLM colocated; one report (report.md + report.json).
#
#   scripts/gpu_check.sh OUT_DIR [options] [-- training flags]
#
# Environments (the script installs nothing unless asked):
#   --python PY        an interpreter with CUDA torch, transformers, trl, vllm (GPU build) and ncgrpo
#                      installed (the vLLM plugin loads from ncgrpo's installed entry point). Default:
#                      .venv-gpu/bin/python if it exists, else python3. A carried venv works where its
#                      base interpreter exists at the same path.
#   --pip-install      a machine with PyPI: make .venv-gpu (python3 -m venv --system-site-packages) and
#                      pip install -e ".[vllm,dev]" into it, then use it.
#   --wheels DIR       a machine with no network: pip install --no-index --no-deps DIR/*.whl, then ncgrpo
#                      itself from this checkout (no build isolation), into a folder put on PYTHONPATH of
#                      --python (a preinstalled CUDA torch stays where it is).
# Parts (each skippable; a failing part is recorded in the report and the next one runs):
#   tests   pytest -m gpu over tests/ (junit XML summarised in the report)
#   model   the Qwen2.5-VL-3B-sized random model, saved once (bench and train read it)
#   bench   benchmarks/bench_vllm_rollout.py --config qwen2_5_vl_3b: vanilla vs NC-GRPO vs sigma-0 requests,
#           G = 12, 16 prompts of >= 448 tokens, 512 new tokens, plus the transformers engine once
#   train   ncgrpo train --config recipes/qwen2_5_vl_7b_latent_sigma0.2.yaml on that model and the
#           synthetic suite: 3 optimizer steps, 4 x 3 accumulation per step, one rollout batch of 4 prompts
#           x 12 (the recipe's 4 updates per rollout batch), vLLM colocated at TP 1 with the recipe's
#           utilization and sleep mode, 512-token responses
# Options:
#   --skip LIST        comma-separated parts to skip (tests,model,bench,train)
#   --work DIR         where the model and the training run go (default ${TMPDIR:-/tmp}/gpu_check_work;
#                      the 3B model is 7.5 GB, so not in OUT_DIR)
#   --train-engine E   vllm (default) or transformers (--use_vllm false: a machine without vLLM)
#   --quick            a smoke run: 4 prompts, 64 new tokens, 64-token responses
#   --part-timeout S   seconds per part before it is stopped and recorded as failed (default 1800)
#   --dry-run          print the plan (environment, each part's command or why it is skipped) and exit
#   -- FLAGS...        appended to the training command (e.g. -- --max_completion_length 2048)
# Writes OUT_DIR/report.md, OUT_DIR/report.json (everything, log tails of failed parts included) and
# OUT_DIR/logs/<part>.log; on a GPU with nvidia-smi, each part's peak memory (sampled every 0.5 s).
# Exit status: 0 when every part that ran passed, 1 otherwise, 2 for bad usage.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="gpu_check.sh"
PARTS=(tests model bench train)
ORIG_ARGS=("$@")

die() { echo "$PROG: error: $*" >&2; exit 2; }
quote() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; echo "${out% }"; }

OUT="" PY="" PIP_INSTALL=0 WHEELS="" SKIP="" WORK="${TMPDIR:-/tmp}/gpu_check_work" ENGINE="vllm"
QUICK=0 PART_TIMEOUT=1800 DRY_RUN=0 TRAIN_EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || die "--python needs a path"; PY="$2"; shift 2 ;;
        --pip-install) PIP_INSTALL=1; shift ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS="$2"; shift 2 ;;
        --skip) [ $# -ge 2 ] || die "--skip needs a list"; SKIP="$2"; shift 2 ;;
        --work) [ $# -ge 2 ] || die "--work needs a folder"; WORK="$2"; shift 2 ;;
        --train-engine) [ $# -ge 2 ] || die "--train-engine needs vllm or transformers"; ENGINE="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --part-timeout) [ $# -ge 2 ] || die "--part-timeout needs seconds"; PART_TIMEOUT="$2"; shift 2 ;;
        --dry-run|--dry_run) DRY_RUN=1; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; TRAIN_EXTRA=("$@"); break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$OUT" ] || die "one OUT_DIR only (got '$OUT' and '$1')"; OUT="$1"; shift ;;
    esac
done
[ -n "$OUT" ] || die "missing OUT_DIR (the folder the report is written to); see --help"
case "$ENGINE" in vllm|transformers) ;; *) die "--train-engine must be vllm or transformers, got '$ENGINE'" ;; esac
case "$PART_TIMEOUT" in ''|*[!0-9]*) die "--part-timeout must be a whole number of seconds, got '$PART_TIMEOUT'" ;; esac
[ "$PART_TIMEOUT" -gt 0 ] || die "--part-timeout must be > 0"
[ $PIP_INSTALL -eq 0 ] || [ -z "$WHEELS" ] || die "--pip-install and --wheels exclude each other"
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels: no folder '$WHEELS'"
IFS=',' read -r -a SKIPPED <<< "$SKIP"
for s in "${SKIPPED[@]}"; do
    case " ${PARTS[*]} " in *" $s "*) ;; *) die "--skip: unknown part '$s' (parts: ${PARTS[*]})" ;; esac
done
skipped() { case ",$SKIP," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

if [ -z "$PY" ]; then
    if [ $PIP_INSTALL -eq 1 ] || [ -x "$ROOT/.venv-gpu/bin/python" ]; then PY="$ROOT/.venv-gpu/bin/python"; else PY="python3"; fi
fi
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
case "$WORK" in /*) ;; *) WORK="$PWD/$WORK" ;; esac
SITE="$WORK/site"
MODEL="$WORK/qwen2_5_vl_3b_random"
REPORT_PY="$(command -v python3 || echo "$PY")"  # the report needs only the standard library

if [ $QUICK -eq 1 ]; then
    BENCH_SIZE=(--prompts 4 --n 6 --prompt-tokens 64 --max-new-tokens 64 --repeats 2 --hf-repeats 1)
    TRAIN_LEN=64
else
    BENCH_SIZE=(--prompts 16 --n 6 --prompt-tokens 448 --max-new-tokens 512 --repeats 3 --hf-repeats 1)
    TRAIN_LEN=512
fi
TRAIN_ENGINE=(--vllm_tensor_parallel_size 1)
[ "$ENGINE" = vllm ] || TRAIN_ENGINE=(--use_vllm false)

# each part: its command (an array, run from the repository root)
CMD_tests=("$PY" -m pytest -m gpu -o addopts= -q -rs -p no:cacheprovider --junitxml "$OUT/logs/tests.xml" tests)
CMD_model=("$PY" benchmarks/bench_vllm_rollout.py --config qwen2_5_vl_3b --model-dir "$MODEL" --build-only)
CMD_bench=("$PY" benchmarks/bench_vllm_rollout.py --config qwen2_5_vl_3b --model-dir "$MODEL" "${BENCH_SIZE[@]}"
    --out "$OUT/logs/bench_vllm_rollout.json")
CMD_train=("$PY" -m ncgrpo.cli train --config recipes/qwen2_5_vl_7b_latent_sigma0.2.yaml
    --model_name_or_path "$MODEL" --dataset_name synthetic --output_dir "$WORK/train" --run_name gpu-check-3b
    --overwrite --max_steps 3 --per_device_train_batch_size 4 --gradient_accumulation_steps 3
    --steps_per_generation 12 --max_completion_length "$TRAIN_LEN" --save_strategy no --logging_steps 1
    "${TRAIN_ENGINE[@]}" ${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"})

SETUP=()
if [ $PIP_INSTALL -eq 1 ]; then
    SETUP=("python3 -m venv --system-site-packages $(quote "$ROOT/.venv-gpu")"
        "$(quote "$PY") -m pip install -e $(quote "$ROOT")'[vllm,dev]'")
elif [ -n "$WHEELS" ]; then
    SETUP=("$(quote "$PY") -m pip install --no-index --no-deps --no-compile --upgrade --target $(quote "$SITE") $(quote "$WHEELS")/*.whl"
        "$(quote "$PY") -m pip install --no-index --no-deps --no-build-isolation --no-compile --upgrade --target $(quote "$SITE") $(quote "$ROOT")")
fi
export PYTHONPATH="$ROOT/src${WHEELS:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1


if [ $DRY_RUN -eq 1 ]; then
    echo "# $PROG plan (dry run: nothing is run or written)"
    echo "report:      $OUT/report.md, $OUT/report.json (logs in $OUT/logs/)"
    echo "python:      $PY"
    echo "PYTHONPATH:  $PYTHONPATH"
    echo "work folder: $WORK (model: $MODEL, training run: $WORK/train)"
    echo "part timeout: ${PART_TIMEOUT}s"
    for c in "${SETUP[@]}"; do echo "setup:       $c"; done
    for part in "${PARTS[@]}"; do
        if skipped "$part"; then
            echo "$part: skipped (--skip)"
        else
            declare -n cmd="CMD_$part"
            echo "$part: $(quote "${cmd[@]}")"
            unset -n cmd
        fi
    done
    echo "report: $REPORT_PY scripts/gpu_check_report.py $OUT"
    exit 0
fi

mkdir -p "$OUT/logs" "$WORK" || die "cannot create $OUT/logs or $WORK"
cd "$ROOT" || die "cannot enter $ROOT"
PARTS_FILE="$OUT/logs/parts.tsv"
: > "$PARTS_FILE"
rm -f -- "$OUT/logs/tests.xml" "$OUT/logs/bench_vllm_rollout.json" "$OUT/logs/"*.mem.csv  # a previous run's
START_TIME="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

# record NAME STATUS RC SECONDS NOTE: one line per part for the report
record() { printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$PARTS_FILE"; }

run_part() {  # run_part NAME CMD...: its log, its peak GPU memory, its status; never aborts the script
    local name="$1"; shift
    local log="$OUT/logs/$name.log" mem="$OUT/logs/$name.mem.csv" sampler="" t0 rc status
    echo "[$PROG] $name: $(quote "$@")" | tee "$log"
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 500 > "$mem" 2> /dev/null &
        sampler=$!
    fi
    t0=$(date +%s)
    if command -v timeout > /dev/null 2>&1; then
        timeout --kill-after=30 "$PART_TIMEOUT" "$@" >> "$log" 2>&1
    else
        "$@" >> "$log" 2>&1
    fi
    rc=$?
    [ -z "$sampler" ] || { kill "$sampler" 2> /dev/null; wait "$sampler" 2> /dev/null; }
    case $rc in
        0) status=passed ;;
        124|137) status=failed; echo "[$PROG] $name: stopped after ${PART_TIMEOUT}s (--part-timeout)" >> "$log" ;;
        *) status=failed ;;
    esac
    [ "$name" != tests ] || [ $rc -ne 5 ] || status=empty  # pytest: no gpu-marked test collected
    record "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" ""
    echo "[$PROG] $name: $status (exit $rc, $(( $(date +%s) - t0 ))s); log: $log"
}

for i in "${!SETUP[@]}"; do
    run_part "setup$((i + 1))" bash -c "${SETUP[$i]}"
done
# what the machine has (never fails the run: the report shows it)
run_part env "$PY" - <<'EOF'
import importlib, importlib.metadata as md, json, platform, subprocess
info = {"python": platform.python_version(), "platform": platform.platform()}
for name in ("torch", "transformers", "trl", "vllm", "deepspeed", "accelerate", "ncgrpo"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "importable, no version")
        except Exception as e:  # noqa: BLE001
            info[name] = None
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["torch_cuda"] = torch.version.cuda
except Exception as e:  # noqa: BLE001
    info["torch_error"] = repr(e)
info["vllm_plugins"] = sorted(e.name for e in md.entry_points(group="vllm.general_plugins"))
info["ncgrpo_plugin_installed"] = "ncgrpo_noise" in info["vllm_plugins"]
print("ENV_JSON " + json.dumps(info))
EOF
for part in "${PARTS[@]}"; do
    if skipped "$part"; then
        record "$part" skipped "" 0 "--skip"
        continue
    fi
    [ "$part" != train ] || rm -rf -- "$WORK/train"  # this script's own run folder: no stale metrics
    declare -n cmd="CMD_$part"
    run_part "$part" "${cmd[@]}"
    unset -n cmd
done

"$REPORT_PY" "$ROOT/scripts/gpu_check_report.py" "$OUT" --work "$WORK" --started "$START_TIME" \
    --command "$(quote "$0" "${ORIG_ARGS[@]}")" || { echo "$PROG: the report could not be written" >&2; exit 1; }
echo "[$PROG] report: $OUT/report.md"
if cut -f2 "$PARTS_FILE" | grep -qx failed; then exit 1; fi
exit 0
