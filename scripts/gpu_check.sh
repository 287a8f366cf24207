#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine with no network, sized to finish inside one call
# (docs/gpu.md; the caps are set from the first two runs on a lent H200, docs/gpu-runs/). Transformers
# engine only (no vLLM there). Every part runs under its own time cap, so one that hangs cannot eat the
# rest, and the whole plan under --budget; each benchmark is also given an inner time cap below its
# part's, so it prints its summary even when the cap cuts its repeats short.
#
#   scripts/gpu_check.sh OUT_DIR [options]
#
# Parts, in order (full scale: a Qwen2.5-VL-shaped random model, Qwen2.5-1.5B text tower, bf16):
#   setup    pip install --no-index --no-deps --target WORK/site WHEELS/*.whl (only with --wheels)
#   env      what the machine has: Python, torch, CUDA, GPU, the versions imported and from where
#   tests    pytest -m gpu over tests/ (the exactness tests on the device: tests/engines/test_cuda_exactness.py)
#   rollout  P1: benchmarks/bench_rollout.py, vanilla vs NC-GRPO with and without the shared prefill,
#            G = 12; tokens/s, peak memory, decode's fraction of the HBM roofline; saves the model
#   step     P2: benchmarks/bench_train.py, optimizer steps of vanilla, latent (shared prefill),
#            latent:noshare and latent:shareloss (shared-prompt loss), interleaved
#   loss     benchmarks/bench_loss_share.py: the shared-prompt loss vs TRL's pass, forward + backward,
#            G = 12, P 800 / C 500 (the recipes' proportions), bf16, sdpa with the block mask
#   train    ncgrpo train --config recipes/qwen2_5_vl_7b_latent_sigma0.2.yaml scaled to the model: 3 steps,
#            transformers engine, one GPU, ZeRO off
#   lora     the same with --use_peft true (LoRA), 2 steps; skipped with the reason when ncgrpo train
#            does not take use_peft
# Options:
#   --python PY      the interpreter (default python3)
#   --wheels DIR     install DIR/*.whl (scripts/gpu_wheels.sh) into WORK/site with no index; WORK/site and
#                    this checkout's src/ go in front of PYTHONPATH (ncgrpo runs from the checkout)
#   --device D       cuda (default) or cpu (the rehearsal, scripts/gpu_rehearse.sh)
#   --scale S        full (default) or tiny (tiny models and few tokens: the CPU rehearsal)
#   --skip LIST      comma-separated parts to skip (tests,rollout,step,loss,train,lora)
#   --budget S       seconds for the whole plan (default 480 at full scale, its caps' sum, inside one
#                    10-minute command; 1200 at tiny scale): a part gets min(its cap, what is left), a part
#                    with under 10 s left is skipped
#   --cap PART=S     one part's cap in seconds (repeatable; e.g. --cap step=200)
#   --work DIR       models, training runs, site-packages (default ${TMPDIR:-/tmp}/gpu_check_work)
#   --keep-logs      leave OUT_DIR/logs/ as a folder (default: packed into OUT_DIR/logs.tar.gz, so that
#                    the report is three files: report.md, report.json, logs.tar.gz)
#   --dry-run        print the plan (each part's cap and command) and exit
# Exit status: 0 when no part failed (skipped parts name their reason), 1 otherwise, 2 for bad usage.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="gpu_check.sh"
PARTS=(tests rollout step loss train lora)
SKIP_RC=77  # a part's command exits with this when it does not apply; its last "SKIP: ..." line says why
ORIG_ARGS=("$@")

die() { echo "$PROG: error: $*" >&2; exit 2; }
quote() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; echo "${out% }"; }

OUT="" PY="python3" WHEELS="" SKIP="" WORK="${TMPDIR:-/tmp}/gpu_check_work" DEVICE=cuda SCALE=full
BUDGET="" DRY_RUN=0 KEEP_LOGS=0 CAP_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || die "--python needs a path"; PY="$2"; shift 2 ;;
        --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS="$2"; shift 2 ;;
        --device) [ $# -ge 2 ] || die "--device needs cuda or cpu"; DEVICE="$2"; shift 2 ;;
        --scale) [ $# -ge 2 ] || die "--scale needs full or tiny"; SCALE="$2"; shift 2 ;;
        --skip) [ $# -ge 2 ] || die "--skip needs a list"; SKIP="$2"; shift 2 ;;
        --budget) [ $# -ge 2 ] || die "--budget needs seconds"; BUDGET="$2"; shift 2 ;;
        --cap) [ $# -ge 2 ] || die "--cap needs PART=SECONDS"; CAP_ARGS+=("$2"); shift 2 ;;
        --work) [ $# -ge 2 ] || die "--work needs a folder"; WORK="$2"; shift 2 ;;
        --keep-logs) KEEP_LOGS=1; shift ;;
        --dry-run|--dry_run) DRY_RUN=1; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [ -z "$OUT" ] || die "one OUT_DIR only (got '$OUT' and '$1')"; OUT="$1"; shift ;;
    esac
done
[ -n "$OUT" ] || die "missing OUT_DIR (the folder the report is written to); see --help"
case "$DEVICE" in cuda|cuda:[0-9]*|cpu) ;; *) die "--device must be cuda or cpu, got '$DEVICE'" ;; esac
case "$SCALE" in full|tiny) ;; *) die "--scale must be full or tiny, got '$SCALE'" ;; esac
is_int() { case "$1" in ''|*[!0-9]*) return 1 ;; *) return 0 ;; esac; }
[ -n "$BUDGET" ] || { [ "$SCALE" = tiny ] && BUDGET=1200 || BUDGET=480; }
is_int "$BUDGET" && [ "$BUDGET" -gt 0 ] || die "--budget must be a whole number of seconds > 0, got '$BUDGET'"
[ -z "$WHEELS" ] || [ -d "$WHEELS" ] || die "--wheels: no folder '$WHEELS'"
if [ -n "$WHEELS" ] && ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then die "--wheels: no .whl file in '$WHEELS'"; fi
IFS=',' read -r -a SKIPPED <<< "$SKIP"
for s in "${SKIPPED[@]}"; do
    case " ${PARTS[*]} " in *" $s "*) ;; *) die "--skip: unknown part '$s' (parts: ${PARTS[*]})" ;; esac
done
skipped() { case ",$SKIP," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# each part's cap in seconds, from the first runs on a lent H200 (docs/gpu.md, "The parts and their
# time plan"): 480 s in all. The benchmarks fill their inner caps (cap - 12 s) with repeats; the others
# end when done (measured there: setup 1-2 s, env 5-6, tests 35, lora 58 with 128 tokens; train logged
# its 3 steps of 256 tokens at ~48 s, then its final save ran into the 50 s cap)
declare -A CAP=([setup]=20 [env]=10 [tests]=50 [rollout]=100 [step]=110 [loss]=55 [train]=70 [lora]=65)
if [ "$SCALE" = tiny ]; then  # a 2-core CPU: tiny models, but every part really runs
    CAP=([setup]=60 [env]=30 [tests]=240 [rollout]=90 [step]=150 [loss]=90 [train]=240 [lora]=180)
fi
for c in ${CAP_ARGS[@]+"${CAP_ARGS[@]}"}; do
    name="${c%%=*}" val="${c#*=}"
    [ -n "${CAP[$name]+x}" ] || die "--cap: unknown part '$name' (parts: ${!CAP[*]})"
    is_int "$val" && [ "$val" -gt 0 ] || die "--cap $name: seconds must be a whole number > 0, got '$val'"
    CAP[$name]=$val
done

case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
case "$WORK" in /*) ;; *) WORK="$PWD/$WORK" ;; esac
LOGS="$OUT/logs"
SITE="$WORK/site"
MODEL="$WORK/model"
REPORT_PY="$(command -v python3 || echo "$PY")"  # the report needs only the standard library

# the parts' commands. The benchmarks' own time caps count from their process's start and stop 12 s
# before their parts' caps: the time left to write the summary and the JSON
if [ "$SCALE" = full ]; then
    DTYPE=bfloat16 SIZE=1.5b
    # 32 new tokens: decode ran ~60 ms a step there, so a 64-token round of 3 arms was 12 s and the 1.5B's
    # build on the CPU (19-27 s), its save and the warm-up left room for one round in 108 s
    ROLLOUT_ARGS=(--size 1.5b --images 1 --image-size 448 --prompts 8 --n 6 --max-new-tokens 32 --repeats 5)
    STEP_ARGS=(--size 1.5b --G 12 --prompts-per-step 1 --max-completion-length 32 --image-size 448 --steps 3 --repeats 3)
    LOSS_ARGS=(--tower 1.5b --kinds vl --G 12 --proxy-P 800 --proxy-C 500 --repeats 15)
    # ncgrpo train always saves the final model (3 GB in bf16; no flag turns that off) and run 1's save
    # ran into the 50 s cap after 3 steps of 256 tokens in 29.5 s: shorter responses, a cap that covers it
    TRAIN_SHAPE=(--max_completion_length 128)
    LORA_SHAPE=(--max_completion_length 64)
else
    DTYPE=float32 SIZE=tiny
    ROLLOUT_ARGS=(--size tiny --images 1 --image-size 56 --prompts 2 --n 2 --max-new-tokens 8 --repeats 3 --threads 1)
    STEP_ARGS=(--size tiny --G 4 --prompts-per-step 1 --max-completion-length 8 --steps 2 --repeats 1 --threads 1)
    LOSS_ARGS=(--tower proxy --kinds vl --G 4 --proxy-P 120 --proxy-C 20 --repeats 3 --threads 1)
    TRAIN_SHAPE=(--max_completion_length 16 --min_pixels 3136 --max_pixels 12544 --use_cpu --bf16 false)
    LORA_SHAPE=("${TRAIN_SHAPE[@]}")
fi
BUILD_MODEL=("$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype "$DTYPE" --size "$SIZE"
    --image-size 448 --build-only --save-model "$MODEL")
RECIPE=recipes/qwen2_5_vl_7b_latent_sigma0.2.yaml
# the 7B recipe's structure on one GPU: one rollout batch of 4 prompts x 12 (steps_per_generation 12 of
# 4 rows) feeding 4 updates of 12 rows (gradient_accumulation_steps 3), as its 192 / 48
TRAIN_BASE=(-m ncgrpo.cli train --config "$RECIPE" --model_name_or_path "$MODEL" --dataset_name synthetic
    --use_vllm false --per_device_train_batch_size 4 --gradient_accumulation_steps 3 --steps_per_generation 12
    --save_strategy no --logging_steps 1 --report_to none --overwrite)
inner() { local cap="$2"; echo $(( cap - 12 > 5 ? cap - 12 : 5 )); }

part_cmd() {  # part_cmd PART CAP: sets CMD (an array) for PART at this cap
    local part="$1" cap="$2"
    case "$part" in
        tests) CMD=(env "NCGRPO_GPU_CHECK_DEVICE=$DEVICE" "$PY" -m pytest -m gpu -o addopts= -q -rs
                -p no:cacheprovider --junitxml "$LOGS/tests.xml" tests) ;;
        rollout) CMD=("$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype "$DTYPE" "${ROLLOUT_ARGS[@]}"
                --time-cap "$(inner rollout "$cap")" --save-model "$MODEL" --out "$LOGS/rollout.json") ;;
        step) CMD=("$PY" benchmarks/bench_train.py --device "$DEVICE" "${STEP_ARGS[@]}"
                --methods vanilla,latent,latent:noshare,latent:shareloss --time-cap "$(inner step "$cap")"
                --out "$LOGS/step.json") ;;
        loss) CMD=("$PY" benchmarks/bench_loss_share.py --device "$DEVICE" --dtype "$DTYPE" "${LOSS_ARGS[@]}"
                --time-cap "$(inner loss "$cap")" --out "$LOGS/loss.json") ;;
        train) CMD=(bash -c "[ -f $(quote "$MODEL/config.json") ] || $(quote "${BUILD_MODEL[@]}") || exit; exec $(quote \
                "$PY" "${TRAIN_BASE[@]}" --output_dir "$WORK/train" --run_name gpu-check --max_steps 3 "${TRAIN_SHAPE[@]}")") ;;
        lora) CMD=(bash -c "$(quote "$PY") scripts/gpu_check_lora_probe.py || exit; [ -f $(quote "$MODEL/config.json") ] \
                || $(quote "${BUILD_MODEL[@]}") || exit; exec $(quote "$PY" "${TRAIN_BASE[@]}" --output_dir "$WORK/lora" \
                --run_name gpu-check-lora --max_steps 2 --use_peft true --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules all-linear "${LORA_SHAPE[@]}")") ;;
    esac
}

SETUP_CMD=()
if [ -n "$WHEELS" ]; then
    SETUP_CMD=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
        --target "$SITE" "$WHEELS"/*.whl)
fi
export PYTHONPATH="$ROOT/src${WHEELS:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCGRPO_GPU_CHECK_DEVICE="$DEVICE"

if [ $DRY_RUN -eq 1 ]; then
    echo "# $PROG plan (dry run: nothing is run or written)"
    echo "report: $OUT/report.md, $OUT/report.json, $OUT/logs.tar.gz"
    echo "python: $PY"
    echo "PYTHONPATH: $PYTHONPATH"
    echo "device: $DEVICE"
    echo "scale: $SCALE"
    echo "work folder: $WORK (model: $MODEL)"
    total=0
    if [ ${#SETUP_CMD[@]} -gt 0 ]; then
        echo "setup: cap ${CAP[setup]}s: $(quote "${SETUP_CMD[@]}")"; total=$((total + CAP[setup]))
    fi
    echo "env: cap ${CAP[env]}s"; total=$((total + CAP[env]))
    for part in "${PARTS[@]}"; do
        if skipped "$part"; then echo "$part: skipped (--skip)"; continue; fi
        part_cmd "$part" "${CAP[$part]}"
        echo "$part: cap ${CAP[$part]}s: $(quote "${CMD[@]}")"
        total=$((total + CAP[$part]))
    done
    echo "caps: ${total}s in all; budget: ${BUDGET}s"
    exit 0
fi

mkdir -p "$LOGS" "$WORK" || die "cannot create $LOGS or $WORK"
cd "$ROOT" || die "cannot enter $ROOT"
rm -f -- "$LOGS"/* "$OUT/logs.tar.gz" "$OUT/report.md" "$OUT/report.json"  # a previous run's
rm -rf -- "$WORK/train" "$WORK/lora"
PARTS_FILE="$LOGS/parts.tsv"
: > "$PARTS_FILE"
START_TIME="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
T_START=$(date +%s)

# record NAME STATUS RC SECONDS CAP NOTE: one line per part for the report
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" >> "$PARTS_FILE"; }

run_part() {  # run_part NAME CAP CMD...: its log, its peak GPU memory, its status; never aborts the script
    local name="$1" cap="$2"; shift 2
    local log="$LOGS/$name.log" mem="$LOGS/$name.mem.csv" sampler="" t0 rc status note="" secs
    echo "[$PROG] $name (cap ${cap}s): $(quote "$@")" | tee "$log"
    if [ "${DEVICE%%:*}" = cuda ] && command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 500 > "$mem" 2> /dev/null &
        sampler=$!
    fi
    t0=$(date +%s)
    if command -v timeout > /dev/null 2>&1; then
        timeout --kill-after=10 "$cap" "$@" >> "$log" 2>&1
    else
        "$@" >> "$log" 2>&1
    fi
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    [ -z "$sampler" ] || { kill "$sampler" 2> /dev/null; wait "$sampler" 2> /dev/null; }
    case $rc in
        0) status=passed ;;
        124|137) status=failed; note="stopped at its ${cap}s cap"; echo "[$PROG] $name: stopped at its ${cap}s cap" >> "$log" ;;
        $SKIP_RC) status=skipped; note="$(grep '^SKIP: ' "$log" | tail -n 1 | cut -c7- | tr '\t' ' ')" ;;
        *) status=failed ;;
    esac
    [ "$name" != tests ] || [ $rc -ne 5 ] || { status=empty; note="no gpu-marked test collected"; }
    record "$name" "$status" "$rc" "$secs" "$cap" "$note"
    echo "[$PROG] $name: $status (exit $rc, ${secs}s of ${cap}s)${note:+: $note}"
}

budget_cap() {  # budget_cap PART: min(its cap, what the budget leaves); empty when under 10 s is left
    local left=$(( BUDGET - ($(date +%s) - T_START) )) cap="${CAP[$1]}"
    [ "$left" -ge 10 ] || return 1
    echo $(( cap < left ? cap : left ))
}

if [ ${#SETUP_CMD[@]} -gt 0 ]; then
    run_part setup "${CAP[setup]}" "${SETUP_CMD[@]}"
fi
# what the machine has (never fails the run: the report shows it)
run_part env "${CAP[env]}" "$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, json, os, platform, sys
# versions and locations without importing the packages (an import of trl or datasets takes seconds):
# the first distribution on sys.path is the one an import would load (the carried wheels come first)
info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
dists = {"math_verify": "math-verify", "huggingface_hub": "huggingface-hub"}
for name in ("torch", "transformers", "trl", "datasets", "accelerate", "peft", "math_verify", "tokenizers",
             "huggingface_hub", "numpy", "ncgrpo"):
    try:
        spec = importlib.util.find_spec(name)
    except Exception as e:  # noqa: BLE001
        spec, info[name + "_error"] = None, f"{type(e).__name__}: {e}"[:300]
    if spec is None:
        info[name] = None
        continue
    info[name + "_from"] = os.path.dirname(os.path.dirname(spec.origin or ""))
    try:
        info[name] = md.version(dists.get(name, name))
    except md.PackageNotFoundError:  # ncgrpo from the checkout's src/ (not installed)
        info[name] = "from source"
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if info["gpus"]:
        p = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["gpu_sms"] = p.multi_processor_count
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
except Exception as e:  # noqa: BLE001
    info["torch_error"] = repr(e)
print("ENV_JSON " + json.dumps(info))
EOF
for part in "${PARTS[@]}"; do
    if skipped "$part"; then
        record "$part" skipped "" 0 "${CAP[$part]}" "--skip"
        continue
    fi
    if ! cap=$(budget_cap "$part"); then
        record "$part" skipped "" 0 "${CAP[$part]}" "the ${BUDGET}s budget was spent"
        echo "[$PROG] $part: skipped (the ${BUDGET}s budget was spent)"
        continue
    fi
    part_cmd "$part" "$cap"
    run_part "$part" "$cap" "${CMD[@]}"
done

"$REPORT_PY" "$ROOT/scripts/gpu_check_report.py" "$OUT" --work "$WORK" --started "$START_TIME" \
    --command "$(quote "$0" "${ORIG_ARGS[@]}")" || { echo "$PROG: the report could not be written" >&2; exit 1; }
if [ $KEEP_LOGS -eq 0 ]; then
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf -- "$LOGS"
fi
echo "[$PROG] $(( $(date +%s) - T_START ))s; report: $OUT/report.md"
"$REPORT_PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["ok"] else 1)' "$OUT/report.json"
