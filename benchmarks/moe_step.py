"""ms per decode step of a small Qwen3-MoE against dense Qwen3 models of its active and of its total size.

    .venv/bin/python benchmarks/moe_step.py --threads 2 --batch 1 32

Three random-weight models (load format dummy) with the same attention, embedding and head: the MoE
(--experts experts of --expert-size intermediate features, top --top-k per token), a dense model whose
MLP is as wide as one token's experts together (the active size), and one as wide as all experts
together (the total size). With grouped experts a step reads each chosen expert's weights once however
many of the step's tokens chose it; at 32 streams nearly every expert is chosen, so the step reads
about the total size's weights while computing the active size's products. Steps are timed by
benchmarks/runner_step.py's bench_decode (wall time of --steps consecutive steps), --rounds times per
batch size in turn over the three models; the median and the fastest round are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from runner_step import bench_decode  # benchmarks/ is the script's folder

from stepahead.bench.report import machine_info, now_utc, write_json
from stepahead.engine.arg_utils import EngineArgs
from stepahead.worker.model_runner import ModelRunner


def _configs(args: argparse.Namespace) -> dict[str, dict]:
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128, head_dim=64,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    moe = dict(common, architectures=["Qwen3MoeForCausalLM"], intermediate_size=args.expert_size,
               num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
               norm_topk_prob=True)
    return {
        f"moe {args.experts}x{args.expert_size} top{args.top_k}": moe,
        f"dense active ({args.top_k * args.expert_size})":
            dict(common, architectures=["Qwen3ForCausalLM"], intermediate_size=args.top_k * args.expert_size),
        f"dense total ({args.experts * args.expert_size})":
            dict(common, architectures=["Qwen3ForCausalLM"], intermediate_size=args.experts * args.expert_size),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    bs = 16
    blocks = 1 + max(args.batch) * -(-(args.context + args.steps + 4) // bs)
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for name, cfg in _configs(args).items():
            folder = Path(tmp) / name.split()[0] / name.split()[1]
            folder.mkdir(parents=True)
            (folder / "config.json").write_text(json.dumps(cfg))
            engine = EngineArgs(model=str(folder), load_format="dummy", device="cpu", dtype="float32",
                                block_size=bs, num_kv_blocks=max(blocks, 1 + 4096 // bs), max_model_len=4096,
                                max_num_seqs=max(64, *args.batch), num_threads=args.threads,
                                executor="uni").create_engine_config()
            runners[name] = ModelRunner(engine)
            params = sum(p.numel() for p in runners[name].model.parameters())
            figures[name] = {"params_M": params / 1e6, "decode_ms": {b: [] for b in args.batch}}
        # Rounds alternate between the models, so a burst of load elsewhere hits all three alike.
        for _ in range(args.rounds):
            for b in args.batch:
                for name, runner in runners.items():
                    figures[name]["decode_ms"][b].append(bench_decode(runner, b, args.context, args.steps, bs, 1,
                                                                      tag=f"d{b}_"))
    for name, fig in figures.items():
        for b, times in fig["decode_ms"].items():
            ms = statistics.median(times)
            print(f"{name:<28s} {fig['params_M']:6.1f}M params  batch={b:<3d}: median {ms:7.2f} ms/step "
                  f"(fastest {min(times):7.2f})  {b / ms * 1e3:6.0f} tok/s  threads={torch.get_num_threads()}")
    if args.json:
        command = " ".join([".venv/bin/python benchmarks/moe_step.py", *sys.argv[1:]])
        write_json(args.json, {"command": command, "date": now_utc(), "machine": machine_info(),
                               "threads": torch.get_num_threads(), "models": figures})


if __name__ == "__main__":
    main()
