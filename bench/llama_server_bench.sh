#!/bin/bash
# llama.cpp's llama-server as a served peer (docs/benchmarks.md#served-28-tiles), driven by
# `vllm bench serve` with bench.served_bench's workload: 64 requests at rate inf, and 16 at
# concurrency 1; random 128 -> 128, greedy, ignore_eos. Build and GGUFs: ../shared/PEERS.md.
#   LLAMA_BIN=<dir with llama-server> GGUF=<prefix: $GGUF-f16.gguf, $GGUF-q8_0.gguf> \
#   MODEL=<the HF checkpoint, for the tokenizer> bench/llama_server_bench.sh
set -u
OUT=${OUT:-bench/results/lcpp}; mkdir -p "$OUT"
PEERV=${VLLM_VENV:-/work/peers/vllm/venv}; CLI=$(dirname "$0")/../../shared/peers/vllm_cli.py
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
for f in f16 q8_0; do
  for par in 64 1; do
    setsid "$LLAMA_BIN/llama-server" -m "$GGUF-$f.gguf" -t 2 --parallel $par -c $((par * 320)) \
      --host 127.0.0.1 --port 8125 --alias peer > "$OUT/srv_${f}_$par.log" 2>&1 &
    p=$!
    for _ in $(seq 1 120); do curl -sf localhost:8125/health > /dev/null && break; sleep 1; done
    if [ $par = 64 ]; then extra="--num-prompts 64"; else extra="--num-prompts 16 --max-concurrency 1"; fi
    "$PEERV/bin/python" "$CLI" bench serve --backend openai --model peer --tokenizer "$MODEL" \
      --host 127.0.0.1 --port 8125 --endpoint /v1/completions --dataset-name random \
      --random-input-len 128 --random-output-len 128 --random-range-ratio 0 $extra --seed 0 \
      --request-rate inf --ignore-eos --temperature 0 --percentile-metrics ttft,tpot,e2el \
      --metric-percentiles 50,99 --disable-tqdm --save-result --save-detailed \
      --result-dir "$OUT" --result-filename "lcpp_${f}_$par.json" > "$OUT/bench_${f}_$par.log" 2>&1
    echo "== $f parallel $par"
    grep -E "Successful|Output token throughput|Median TTFT|Median TPOT" "$OUT/bench_${f}_$par.log"
    kill -TERM -- -$p; sleep 3; kill -KILL -- -$p 2> /dev/null
  done
done
