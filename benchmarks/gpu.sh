#!/usr/bin/env bash
# The one GPU script: on one CUDA GPU, with nano-vllm's bench.py protocol (a Qwen3-0.6B-shaped model with
# dummy bf16 weights, 256 sequences, input and output lengths uniform in [100, 1024] token ids,
# ignore_eos, temperature 0.6), in about 8 minutes:
#   1. the CUDA tests (Triton kernels, graph replay vs eager, greedy ids vs transformers float32);
#   2. async (step-ahead) vs sync scheduling: output throughput, GPU utilization, a timeline PNG;
#   3. ms per decode step at batch 64 (context ~500) and 256 (context ~850);
#   4. transformers generate_batch (bf16) on the same requests.
# Everything it prints also goes to OUTDIR/gpu-<stamp>.log, beside the JSON, trace and PNG files.
#
#   bash benchmarks/gpu.sh [OUTDIR]            # default OUTDIR: benchmarks/results
#
# On the lent GPU machine: give OUTDIR under $OUT (only that comes back) and carry .whl/ along with the
# working tree (it is git-ignored). The parts' timeouts add up to under 600 s, one device command's limit.
#
# Missing Python packages travel as wheels in .whl/ (benchmarks/fetch_gpu_wheels.sh fills it) and are
# installed into /tmp/site. Environment overrides: PYTHON, NUM_PROMPTS (256), MIN_LEN (100),
# MAX_LEN (1024), ROUNDS (1), TIME_BUDGET (seconds of rounds, 100), EXECUTOR (mp), NUM_KV_BLOCKS
# (24576 per engine), SKIP (space-separated parts to skip: tests compare decode transformers),
# SMOKE=1 (a 2-layer model and 16 short sequences on CPU: checks this script anywhere in a minute).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-$REPO/benchmarks/results}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"

# The repo's venv when it has a CUDA torch (or in SMOKE mode); else the machine's python3.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  if [ -x "$REPO/.venv/bin/python" ] && \
     "$REPO/.venv/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() or "'"${SMOKE:-0}"'" == "1" else 1)' 2>/dev/null; then
    PY="$REPO/.venv/bin/python"
  fi
fi
STAMP="$(date -u +%Y%m%d-%H%M%S)"
LOG="$OUTDIR/gpu-$STAMP.log"
exec > >(tee -a "$LOG") 2>&1   # everything below is also in the log
# Packages the GPU machine lacks, shipped as wheels (benchmarks/fetch_gpu_wheels.sh); run from the tree.
SITE=""
if ! "$PY" -c "import fastapi, pydantic, uvicorn, zmq, msgspec, gguf" 2>/dev/null \
   && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  SITE=/tmp/stepahead-site
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$REPO"/.whl/*.whl
fi
export PYTHONPATH="$REPO${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

"$PY" - <<'EOF'
import importlib, os, sys
missing = [m for m in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "matplotlib", "tqdm",
                       "fastapi", "pydantic", "zmq", "msgspec", "gguf")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu.sh: python lacks {missing}")
import torch
if os.environ.get("SMOKE") != "1" and not torch.cuda.is_available():
    sys.exit("gpu.sh: no CUDA device visible to torch (SMOKE=1 runs a small CPU check instead)")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}",
      f"on {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "on CPU")
EOF

MODEL_DIR="$(mktemp -d)"
trap 'rm -rf "$MODEL_DIR"' EXIT

# Qwen3-0.6B's config.json shape (dummy weights are drawn at load time) and a word-level tokenizer
# that names every one of the 151,936 ids, so any sampled id detokenizes. SMOKE shrinks the model.
"$PY" - "$MODEL_DIR" <<'EOF'
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
folder = sys.argv[1]
smoke = os.environ.get("SMOKE") == "1"
cfg = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
if smoke:
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, max_window_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, torch_dtype="float32")
json.dump(cfg, open(os.path.join(folder, "config.json"), "w"), indent=1)
specials = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
vocab = {specials.get(i, f"<t{i}>"): i for i in range(cfg["vocab_size"])}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
tok.add_special_tokens(list(specials.values()))
tok.save(os.path.join(folder, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "unk_token": "<|endoftext|>", "model_max_length": 40960},
          open(os.path.join(folder, "tokenizer_config.json"), "w"))
print(f"model folder {folder}: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, dummy weights")
EOF

if [ "${SMOKE:-0}" = "1" ]; then
  NUM_PROMPTS="${NUM_PROMPTS:-16}"; MIN_LEN="${MIN_LEN:-8}"; MAX_LEN="${MAX_LEN:-48}"
  NUM_KV_BLOCKS="${NUM_KV_BLOCKS:-256}"; DEVICE=cpu; SKIP="${SKIP-tests transformers}"
  DECODE_SHAPES="4:40 8:60"
else
  DEVICE=cuda; SKIP="${SKIP:-}"
  DECODE_SHAPES="64:500 256:850"  # batch:context
fi
NUM_PROMPTS="${NUM_PROMPTS:-256}"; MIN_LEN="${MIN_LEN:-100}"; MAX_LEN="${MAX_LEN:-1024}"
ROUNDS="${ROUNDS:-1}"; TIME_BUDGET="${TIME_BUDGET:-100}"; EXECUTOR="${EXECUTOR:-mp}"
# Both engines live at once (they alternate): an explicit pool keeps them equal and leaves room.
NUM_KV_BLOCKS="${NUM_KV_BLOCKS:-24576}"
MAX_MODEL_LEN=$(( 2 * MAX_LEN > 256 ? 2 * MAX_LEN : 256 ))
BASE="$OUTDIR/gpu-qwen3-0.6b-dummy-$STAMP"
WORKLOAD=(--model "$MODEL_DIR" --load-format dummy --device "$DEVICE" --executor "$EXECUTOR"
          --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens 16384
          --num-kv-blocks "$NUM_KV_BLOCKS"
          --num-prompts "$NUM_PROMPTS" --input-len "$MIN_LEN:$MAX_LEN" --output-len "$MIN_LEN:$MAX_LEN"
          --temperature 0.6 --ignore-eos --seed 0)
wants() { [[ " $SKIP " != *" $1 "* ]]; }
part() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }

if wants tests; then
  part "1. CUDA tests"
  timeout 110 "$PY" -m pytest -q -p no:cacheprovider -x -k cuda "$REPO/tests/attention/test_triton_paged.py" \
    "$REPO/tests/worker/test_runner_triton.py" "$REPO/tests/worker/test_kv_memory.py" || echo "CUDA tests FAILED or timed out"
fi

if wants compare; then
  part "2. async vs sync, nano-vllm protocol"
  timeout $(( TIME_BUDGET + 90 )) "$PY" -m stepahead.entrypoints.cli bench throughput "${WORKLOAD[@]}" \
    --compare sync --rounds "$ROUNDS" --time-budget "$TIME_BUDGET" \
    --json "$BASE.json" --trace "$BASE-trace.json" --plot "$BASE.png" --plot-steps 8 || echo "compare FAILED or timed out"
fi

if wants decode; then
  part "3. ms per decode step"
  for shape in $DECODE_SHAPES; do
    batch="${shape%%:*}"; context="${shape##*:}"
    timeout 60 "$PY" "$REPO/benchmarks/runner_step.py" --model "$MODEL_DIR" --load-format dummy --device "$DEVICE" \
      --batch "$batch" --context "$context" --steps 20 --prefill 0 --json "$OUTDIR/gpu-decode-b$batch-$STAMP.json" \
      || echo "decode batch $batch FAILED or timed out"
  done
fi

if wants transformers; then
  part "4. transformers generate_batch, same requests (greedy on both sides)"
  timeout 150 "$PY" -m stepahead.entrypoints.cli bench throughput "${WORKLOAD[@]}" \
    --compare transformers --hf-baselines generate_batch --json "$BASE-vs-transformers.json" \
    || echo "transformers comparison FAILED or timed out"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
echo "wrote $LOG and $BASE*"
