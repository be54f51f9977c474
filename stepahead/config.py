"""EngineArgs (the single source of LLM kwargs and CLI flags) and the resolved EngineConfig."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from stepahead.validation import check_field

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_KV_CACHE_BYTES_CPU = 2 << 30

# Allowed values of EngineArgs' string fields (the CLI offers the same as choices).
CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "executor": ("mp", "uni"),
    "load_format": ("auto", "safetensors", "gguf", "dummy"),
    "device": ("auto", "cpu", "cuda"),
}


@dataclass
class ModelConfig:
    """What the engine needs to know about a checkpoint; filled by models.loader.load_model_config."""

    model: str  # folder or .gguf file
    architecture: str  # e.g. "LlamaForCausalLM"
    hf_config: dict  # the config.json-style dict (for a GGUF file: translated from its metadata)
    dtype: str  # "float32" | "bfloat16" | "float16" (resolved, never "auto")
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_id: int | None
    seed: int = 0
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    served_model_name: str | None = None
    tokenizer: str | None = None  # folder holding the tokenizer; defaults to the model's

    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: off
    debug_invariants: bool = False  # check engine-spec §2.3 invariants after every schedule/update

    def __post_init__(self) -> None:
        check_field(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        check_field(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        check_field(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        if not self.enable_chunked_prefill:
            check_field(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens", self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is disabled",
            )


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024  # including the reserved null block 0
    enable_prefix_caching: bool = True
    # Park freed blocks until every in-flight step that may write them has been processed (§2.11).
    defer_block_free: bool = False

    def __post_init__(self) -> None:
        check_field(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        check_field(self.num_blocks >= 2, "num_blocks", self.num_blocks, "must be >= 2 (block 0 is reserved)")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    async_scheduling: bool
    max_concurrent_batches: int  # batch-queue depth: 2 with async, 1 without, more to study PP
    executor: str  # "mp" | "uni"
    device: str  # "cpu" | "cuda"
    num_threads: int | None = None  # torch threads in the worker; None: decided by the executor
    trace: bool = False


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names. LLM(**kwargs) and the CLI flags both come from here."""

    model: str | None = None  # None: the built-in SmolLM2-135M-Instruct
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None
    max_concurrent_batches: int | None = None
    executor: str = "mp"
    load_format: str = "auto"
    device: str = "auto"
    num_threads: int | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    debug_invariants: bool = False
    defer_block_free: bool = False
    trace: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            check_field(value in allowed, name, value, f"must be one of {', '.join(allowed)}")
        check_field(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
               "must be a power of two in [1, 128]")
        check_field(self.max_concurrent_batches is None or self.max_concurrent_batches >= 1,
               "max_concurrent_batches", self.max_concurrent_batches, "must be >= 1")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only the frontend resolving a config touches torch here

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_engine_config(self) -> EngineConfig:
        from stepahead.models.loader import load_model_config

        device = self.resolve_device()
        model_config = load_model_config(self, device)
        max_model_len = model_config.max_model_len
        max_batched = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                         0 if self.enable_chunked_prefill else max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            debug_invariants=self.debug_invariants,
        )
        blocks_per_seq = -(-max_model_len // self.block_size)
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            budget = self.kv_cache_memory_bytes or _default_kv_budget(device)
            num_blocks = budget // (self.block_size * model_config.kv_bytes_per_token())
            # No need for more than every sequence at full length.
            num_blocks = min(num_blocks, self.max_num_seqs * blocks_per_seq + 1)
        check_field(num_blocks - 1 >= blocks_per_seq, "num_kv_blocks", num_blocks,
               f"must hold one max_model_len ({max_model_len}) sequence: at least {blocks_per_seq + 1} "
               f"blocks of {self.block_size} tokens (block 0 is reserved); lower max_model_len or raise the pool")
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            defer_block_free=self.defer_block_free,
        )
        async_scheduling = resolve_async_scheduling(self.async_scheduling)
        depth = self.max_concurrent_batches or (2 if async_scheduling else 1)
        return EngineConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            async_scheduling=async_scheduling,
            max_concurrent_batches=depth,
            executor=self.executor,
            device=device,
            num_threads=self.num_threads,
            trace=self.trace,
        )


def resolve_async_scheduling(requested: bool | None) -> bool:
    """None means auto: on, unless something incompatible is configured.

    Every executor and feature stepahead has today supports async scheduling (structured output
    defers sampling instead, as the seed describes), so auto resolves to True.
    """
    return True if requested is None else bool(requested)


def _default_kv_budget(device: str) -> int:
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free * 0.5)
    return DEFAULT_KV_CACHE_BYTES_CPU
