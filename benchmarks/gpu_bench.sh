#!/usr/bin/env bash
# Device script 2 of 2: benchmarks on one CUDA GPU with nano-vllm's bench.py protocol (a Qwen3-0.6B-shaped
# model with dummy bf16 weights, 256 sequences, input and output lengths uniform in [100, 1024] token ids,
# ignore_eos, temperature 0.6), in parts each bounded by a timeout and run whatever the others did (the
# timeouts add to 520 s, inside one 600 s device command):
#   compare          async (step-ahead) vs sync scheduling: output throughput, GPU utilization, a timeline PNG;
#   decode-bN        ms per decode step at batch 64 (context ~500) and 256 (context ~850);
#   verify-rows      ms per decode step at 1, 5, 32 and 160 rows (context ~500): what verifying four drafts
#                    per request costs at one and at 32 streams (5 and 160 rows) against plain decoding;
#   transformers     transformers generate_batch (bf16) against stepahead on the same requests (64 of them
#                    by default: generate_batch runs ~800 tok/s, and 256 would not fit its limit).
# The summary at the end gives every part's status; the script exits nonzero when any failed. Everything
# it prints also goes to OUTDIR/gpu-bench-<stamp>.log, beside the JSON, trace and PNG files. Device
# script 1 (the CUDA tests) is benchmarks/gpu_tests.sh.
#
#   bash benchmarks/gpu_bench.sh [OUTDIR]      # default OUTDIR: benchmarks/results
#
# On the lent GPU machine: give OUTDIR under $OUT (only that comes back) and carry .whl/ along with the
# working tree (git-ignored; benchmarks/fetch_gpu_wheels.sh fills it).
# Environment (all prefixed STEPAHEAD_GPU_): PYTHON (default: the repo's venv if it has CUDA, else
# python3), NUM_PROMPTS (256), MIN_LEN (100), MAX_LEN (1024), ROUNDS (1), TIME_BUDGET (seconds of
# rounds, 100), EXECUTOR (mp), NUM_KV_BLOCKS (24576 per engine), HF_PROMPTS (64), SKIP (part names to
# skip: compare decode-b64 decode-b256 verify-rows transformers), SMOKE=1 (a 2-layer model and 16 short sequences
# on CPU, transformers skipped unless SKIP is set: checks this script anywhere in a minute).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
gpu_setup gpu-bench "${1:-}"

MODEL_DIR="$(mktemp -d)"
trap 'rm -rf "$MODEL_DIR"' EXIT

# Qwen3-0.6B's config.json shape (dummy weights are drawn at load time) and a word-level tokenizer
# that names every one of the 151,936 ids, so any sampled id detokenizes. SMOKE shrinks the model.
"$PY" - "$MODEL_DIR" <<'EOF'
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
folder = sys.argv[1]
smoke = os.environ.get("STEPAHEAD_GPU_SMOKE") == "1"
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

if [ "$SMOKE" = 1 ]; then
  defaults=(16 8 48 256)   # prompts, min and max length, KV blocks
  export STEPAHEAD_GPU_SKIP="${STEPAHEAD_GPU_SKIP-transformers}"
  DECODE_SHAPES="4:40 8:60"
  VERIFY_ROWS="1 5"; VERIFY_CONTEXT=40
else
  defaults=(256 100 1024 24576)
  DECODE_SHAPES="64:500 256:850"  # batch:context
  VERIFY_ROWS="1 5 32 160"; VERIFY_CONTEXT=500
fi
NUM_PROMPTS="${STEPAHEAD_GPU_NUM_PROMPTS:-${defaults[0]}}"
MIN_LEN="${STEPAHEAD_GPU_MIN_LEN:-${defaults[1]}}"; MAX_LEN="${STEPAHEAD_GPU_MAX_LEN:-${defaults[2]}}"
ROUNDS="${STEPAHEAD_GPU_ROUNDS:-1}"; TIME_BUDGET="${STEPAHEAD_GPU_TIME_BUDGET:-100}"
EXECUTOR="${STEPAHEAD_GPU_EXECUTOR:-mp}"; HF_PROMPTS="${STEPAHEAD_GPU_HF_PROMPTS:-64}"
# Both engines live at once (they alternate): an explicit pool keeps them equal and leaves room.
NUM_KV_BLOCKS="${STEPAHEAD_GPU_NUM_KV_BLOCKS:-${defaults[3]}}"
MAX_MODEL_LEN=$(( 2 * MAX_LEN > 256 ? 2 * MAX_LEN : 256 ))
BASE="$OUTDIR/gpu-qwen3-0.6b-dummy-$STAMP"
ENGINE=(--model "$MODEL_DIR" --load-format dummy --device "$DEVICE" --executor "$EXECUTOR"
        --max-model-len "$MAX_MODEL_LEN" --max-num-seqs 256 --max-num-batched-tokens 16384
        --num-kv-blocks "$NUM_KV_BLOCKS"
        --input-len "$MIN_LEN:$MAX_LEN" --output-len "$MIN_LEN:$MAX_LEN" --temperature 0.6 --ignore-eos --seed 0)
CLI=("$PY" -m stepahead.entrypoints.cli bench throughput)

gpu_part compare $(( TIME_BUDGET + 90 )) "${CLI[@]}" "${ENGINE[@]}" --num-prompts "$NUM_PROMPTS" \
  --compare sync --rounds "$ROUNDS" --time-budget "$TIME_BUDGET" \
  --json "$BASE.json" --trace "$BASE-trace.json" --plot "$BASE.png" --plot-steps 8

for shape in $DECODE_SHAPES; do
  batch="${shape%%:*}"; context="${shape##*:}"
  gpu_part "decode-b$batch" 60 "$PY" "$REPO/benchmarks/runner_step.py" --model "$MODEL_DIR" --load-format dummy \
    --device "$DEVICE" --batch "$batch" --context "$context" --steps 20 --prefill 0 \
    --json "$OUTDIR/gpu-decode-b$batch-$STAMP.json"
done

# Speculative decoding's verifying step with four drafts is a decode step of 1 + 4 rows per request.
gpu_part verify-rows 60 "$PY" "$REPO/benchmarks/runner_step.py" --model "$MODEL_DIR" --load-format dummy \
  --device "$DEVICE" --batch $VERIFY_ROWS --context "$VERIFY_CONTEXT" --steps 20 --prefill 0 \
  --json "$OUTDIR/gpu-verify-rows-$STAMP.json"

# Greedy on both sides (--compare transformers sets it).
gpu_part transformers 150 "${CLI[@]}" "${ENGINE[@]}" --num-prompts "$HF_PROMPTS" \
  --compare transformers --hf-baselines generate_batch --json "$BASE-vs-transformers.json"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
echo "wrote $BASE*"
gpu_finish
