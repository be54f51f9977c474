"""What the model runner and the draft model proposer set up alike around a loaded model: the device's
faster paths and the attention backend that builds each step's metadata.
"""

from __future__ import annotations

import torch

from stepahead.attention.sdpa import SdpaBackend
from stepahead.attention.triton_backend import TritonBackend
from stepahead.config import EngineConfig
from stepahead.models import onednn_linear


def use_fast_paths(model, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Once loading is done: dense float32 projections through oneDNN on CPU (models/onednn_linear.py),
    norms and rope as fused Triton kernels on CUDA with the Triton backend (attention/triton_fused.py)."""
    if onednn_linear.available(device, dtype):
        model.use_onednn()
    if device.type == "cuda" and config.attention_backend == "triton":
        model.use_triton_fused()


def new_attention_backend(config: EngineConfig, block_size: int, max_blocks_per_seq: int, max_tokens: int,
                          device: torch.device, decode_kernel: bool) -> SdpaBackend | TritonBackend:
    """config.attention_backend's backend for steps of up to max_tokens tokens. decode_kernel: the CPU
    backend attends decode rows with stepahead's kernel (the model's cpu_kernels)."""
    if config.attention_backend == "triton":
        return TritonBackend(block_size)
    arange = torch.arange(max_blocks_per_seq * block_size + max_tokens, device=device)
    return SdpaBackend(block_size, max_blocks_per_seq, arange, decode_kernel=decode_kernel)
