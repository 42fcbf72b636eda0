#!/usr/bin/env bash
# The GPU check of issue 38, in one run under 8 minutes on one H200:
# - the reuse matrix, the batching tests and the static decode tests on CUDA (float32, TENZRO_TEST_DEVICE=cuda);
# - `bench reuse`, `bench load` and `bench seal` on the 1B Llama shape (`models init --size 1b`, bf16, the node's
#   default on CUDA);
# - per family, how many of the matrix's requests agree token for token with reuse on and off in bfloat16
#   (`scripts/dtype_agreement.py`);
# - `bench load` at 32 clients again with decode steps eager (TENZRO_CUDA_GRAPHS=off): the A/B of the steps replayed
#   as CUDA graphs (`node/engine/static_decode.py`);
# - the cross-caller timing audit on the 1B shape (`tenzro audit timing`: caller B's TTFT must not tell whether
#   caller A just sent the prompt, while A's own reuse is detected);
# - last, where the budget still allows, `bench load` at 32 clients on the hybrid of the same scale (static steps
#   with recurrent states).
# Writes device_check.log (every step's output), device_check.json (each step's exit status and seconds) and the
# benches' JSON under $OUT.
#
# Meant for a machine without network whose Python already has torch: wheels it lacks (cryptography, openai,
# pytest-asyncio, a matching transformers: ../shared/GPU-NOTES.md) are carried in .whl/ and installed into a
# target directory on PYTHONPATH; the project itself is imported from this checkout (PYTHONPATH), so neither it nor
# its `tenzro` script need be installed (the tests start nodes as `python -m node`).
#
# Each step runs under a time limit and the run under DEVICE_CHECK_SECONDS in all: a step that fails or runs out
# of time is recorded and the next one runs, so one failure still leaves the other figures. The exit status is
# that of the first failed step (0 when all passed).
#
# DEVICE_CHECK_DRY_RUN=1 prints the commands, one a line, and runs none. DEVICE_CHECK_DEVICE and DEVICE_CHECK_SIZE
# (cuda, 1b) choose another device or model size; the benches' 16k prompts need the 1b size's 32k context.
set -uo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
device="${DEVICE_CHECK_DEVICE:-cuda}"
size="${DEVICE_CHECK_SIZE:-1b}"
wheels="${DEVICE_CHECK_WHEELS:-.whl}"
work="${DEVICE_CHECK_WORK:-/tmp/tenzro-device-check}"
out="${OUT:-bench-results/device-check}"
budget="${DEVICE_CHECK_SECONDS:-460}"
dry="${DEVICE_CHECK_DRY_RUN:-}"
model="$work/dense-$size"
log="$out/device_check.log"

export PYTHONPATH="$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TENZRO_HOME="$work/home" TENZRO_TEST_DEVICE="$device"

first_failure=0
steps=()

# step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds, or what is left of the budget if less.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n "$dry" ]]; then
    printf '%s\n' "$*"
    return
  fi
  local left=$((budget - SECONDS)) rc started=$SECONDS
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    rc=124
    printf '\n=== %s: skipped, the budget of %s s is spent\n' "$name" "$budget" >>"$log"
  else
    printf '\n=== %s (at most %s s): %s\n' "$name" "$limit" "$*" >>"$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
  fi
  printf '=== %s: exit %s after %s s\n' "$name" "$rc" "$((SECONDS - started))" | tee -a "$log"
  steps+=("{\"step\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - started))}")
  ((rc != 0 && first_failure == 0)) && first_failure=$rc
  return 0
}

if [[ -z "$dry" ]]; then
  mkdir -p "$out" "$work"
  rm -rf "$model" "$work/hybrid-$size"
  : >"$log"
fi

step machine 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
mapfile -t carried < <(compgen -G "$wheels/*.whl" | sort)
if ((${#carried[@]})); then
  step wheels 40 "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --find-links "$wheels" --target "$work/site" "${carried[@]}"
fi
step versions 20 "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
step reuse-matrix 110 "$python" -m pytest -q -p no:cacheprovider -n 8 tests/node/test_reuse_matrix.py
step batching 55 "$python" -m pytest -q -p no:cacheprovider -n 4 tests/node/engine/test_batching.py \
  tests/node/engine/test_static_decode.py
step model 45 "$python" -m node models init --arch dense --size "$size" "$model"
step bench-reuse 60 "$python" -m node bench reuse --device "$device" --lengths 1024,4096,16384 --runs 3 \
  --model "$model" --out "$out/reuse-$size.json"
step bench-load 85 "$python" -m node bench load --device "$device" --clients 1,8,32,64 --duration 12 \
  --model "$model" --json "$out/load-$size.json"
step bench-seal 50 "$python" -m node bench seal --device "$device" --lengths 1024,4096,16384 --runs 3 \
  --model "$model" --out "$out/seal-$size.json"
step bf16-agreement 60 "$python" scripts/dtype_agreement.py --device "$device" --dtype bfloat16 \
  --out "$out/bf16-agreement.json"
step bench-load-eager 40 env TENZRO_CUDA_GRAPHS=off "$python" -m node bench load --device "$device" --clients 32 \
  --duration 12 --model "$model" --json "$out/load-$size-eager.json"
step audit-timing 70 "$python" -m node audit timing --device "$device" --model "$model" --samples 30 --length 4096 \
  --seed 38 --out "$out/audit-timing.json"
step model-hybrid 45 "$python" -m node models init --arch hybrid --size "$size" "$work/hybrid-$size"
step bench-load-hybrid 50 "$python" -m node bench load --device "$device" --clients 32 --duration 12 \
  --model "$work/hybrid-$size" --json "$out/load-$size-hybrid.json"

if [[ -z "$dry" ]]; then
  joined=$(IFS=,; printf '%s' "${steps[*]}")
  printf '{"device": "%s", "size": "%s", "budget_s": %s, "seconds": %s, "steps": [%s]}\n' \
    "$device" "$size" "$budget" "$SECONDS" "$joined" >"$out/device_check.json"
  grep -n -A25 Traceback "$log" | head -200
fi
exit "$first_failure"
