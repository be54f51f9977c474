#!/usr/bin/env bash
# `stepahead serve FILE` against llama.cpp's `llama-server` on the same GGUF file, side by side: in each
# round one server at a time (fresh each round, the order alternating), each loaded by `stepahead bench
# serve` with 64-token prompts and 128 output tokens, greedy, ignore_eos: 32 prompts at 32 streams,
# then 4 at one stream (another --seed, so no prompt is cached). Prints output tok/s and the ratio
# per round; the JSON results stay in OUTDIR.
#
#   benchmarks/vs_llama_server.sh GGUF LLAMA_SERVER TOKENIZER_DIR [ROUNDS] [OUTDIR]
#
# TOKENIZER_DIR: a folder with the model's tokenizer (the model cache's entry for the GGUF file).
# STEPAHEAD_SERVE_ARGS: extra `stepahead serve` flags, BENCH_ARGS: extra `bench serve` flags for both
# engines, each split on spaces (so a JSON value is written without any), e.g.
#   STEPAHEAD_SERVE_ARGS='--speculative-config {"method":"ngram","num_speculative_tokens":4}'
#   BENCH_ARGS='--dataset-name copy'
# LLAMA_THREADS: llama-server's -t (default 2). On a machine whose cores other work also uses, its
# threads spin at every barrier for a partner that lost its core; -t 1 has no barriers to wait at.
# llama.cpp is built as docs/BENCHMARKS.md section 14.1 says; it is no dependency of stepahead.
set -euo pipefail
GGUF=$1 LLAMA_SERVER=$2 TOKENIZER=$3 ROUNDS=${4:-3} OUT=${5:-/tmp/vs-llama-server}
STEPAHEAD=${STEPAHEAD:-.venv/bin/stepahead}
LLAMA_THREADS=${LLAMA_THREADS:-2}
read -ra SERVE_ARGS <<<"${STEPAHEAD_SERVE_ARGS:-}"
read -ra EXTRA_BENCH_ARGS <<<"${BENCH_ARGS:-}"
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

wait_up() {  # port
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
    sleep 1
  done
  echo "server on port $1 did not come up" >&2
  return 1
}

bench() {  # engine port round
  for shape in "32 32 1" "4 1 2"; do
    read -r prompts streams seed <<<"$shape"
    "$STEPAHEAD" bench serve --base-url "http://127.0.0.1:$2" --tokenizer "$TOKENIZER" --num-prompts "$prompts" \
      --random-input-len 64 --random-output-len 128 --max-concurrency "$streams" --ignore-eos --temperature 0 \
      --num-warmups 1 --seed "$seed" --disable-tqdm --save-result --result-dir "$OUT" \
      --result-filename "$1-c$streams-r$3.json" "${EXTRA_BENCH_ARGS[@]}" >"$OUT/$1-c$streams-r$3.log" 2>&1
  done
}

for round in $(seq "$ROUNDS"); do
  order="llama stepahead"
  if [ $((round % 2)) -eq 0 ]; then order="stepahead llama"; fi
  for engine in $order; do
    if [ "$engine" = llama ]; then
      port=8091
      "$LLAMA_SERVER" -m "$GGUF" -t "$LLAMA_THREADS" -np 32 -c 8192 -cb --port "$port" >"$OUT/llama-server.log" 2>&1 &
    else
      port=8092
      "$STEPAHEAD" serve "$GGUF" --port "$port" "${SERVE_ARGS[@]}" >"$OUT/stepahead-serve.log" 2>&1 &
    fi
    pid=$!
    wait_up "$port"
    bench "$engine" "$port" "$round"
    kill "$pid"
    wait "$pid" || true
  done
done

"$PYTHON" - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def tps(engine, streams, r):
    return json.load(open(f"{out}/{engine}-c{streams}-r{r}.json"))["output_throughput"]
print("| round | llama-server c=32 | stepahead c=32 | ratio | llama-server c=1 | stepahead c=1 | ratio |")
print("|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    cells = []
    for streams in (32, 1):
        a, b = tps("llama", streams, r), tps("stepahead", streams, r)
        cells += [f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"]
    print(f"| {r} | " + " | ".join(cells) + " |")
EOF
