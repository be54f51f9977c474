"""Phi-3 and Phi-4 (Phi3ForCausalLM; Phi-4 and Phi-4-mini checkpoints use it too): the Llama layers
(models/llama.py) with q/k/v and gate/up already fused in the checkpoint, LongRoPE scaling and, in
Phi-4-mini, rope over the first 3/4 of each head (both in models/rope.py).

The checkpoint's qkv_proj holds [q heads | k heads | v heads] rows and gate_up_proj [gate | up], the
layout LlamaForCausalLM computes in; a tensor-parallel rank reads its heads and its intermediate
slice out of each part.
"""

from __future__ import annotations

from stepahead.models.llama import LlamaForCausalLM
from stepahead.models.llama_args import LlamaArgs
from stepahead.models.llama_weights import ShardRead

SUPPORTED_ARCHITECTURES = ("Phi3ForCausalLM",)


def phi3_args(arch: str, cfg: dict) -> LlamaArgs:
    """LlamaArgs of a Phi-3 config (no q/k/v bias, no per-head norms)."""
    args = LlamaArgs.from_hf_config(arch, cfg)
    args.qkv_bias = False
    return args


def _within(read: ShardRead, start: int, full: int) -> ShardRead:
    """A part's read moved to where the part starts in a fused checkpoint tensor of `full` rows."""
    return read._replace(start=start + read.start, full=full)


class Phi3ForCausalLM(LlamaForCausalLM):
    def shard_reads(self) -> dict[str, tuple[str, tuple[ShardRead, ...]]]:
        r = self.part_reads()
        q, k, v, gate, up = r["q_proj"], r["k_proj"], r["v_proj"], r["gate_proj"], r["up_proj"]
        qkv_rows, gate_up_rows = q.full + k.full + v.full, gate.full + up.full
        return {
            "self_attn.qkv_proj.": ("self_attn.qkv_proj.", (
                _within(q, 0, qkv_rows), _within(k, q.full, qkv_rows), _within(v, q.full + k.full, qkv_rows))),
            "mlp.gate_up_proj.": ("mlp.gate_up_proj.", (
                _within(gate, 0, gate_up_rows), _within(up, gate.full, gate_up_rows))),
            "self_attn.o_proj.": ("self_attn.o_proj.", (r["o_proj"],)),
            "mlp.down_proj.": ("mlp.down_proj.", (r["down_proj"],)),
        }
