"""EngineArgs: every engine knob with vLLM's names, the single source of LLM(**kwargs) and CLI flags.

Each field carries its flag help in its metadata, so a new field becomes a documented flag of every
subcommand without touching the CLI. create_engine_config() resolves the arguments (device, model
config, KV pool size, batch-queue depth) into the EngineConfig the engine runs with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from stepahead.config import (
    DEFAULT_KV_CACHE_BYTES_CPU,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from stepahead.utils import cdiv
from stepahead.validation import check_field

# Allowed values of EngineArgs' string fields (the CLI offers the same as choices).
CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "executor": ("mp", "uni"),
    "load_format": ("auto", "safetensors", "gguf", "dummy"),
    "device": ("auto", "cpu", "cuda"),
    "attention_backend": ("auto", "sdpa", "triton"),
    "structured_outputs_backend": ("xgrammar", "none"),
    "quantization": QUANTIZATION_CHOICES,
    "kv_cache_dtype": KV_CACHE_DTYPE_CHOICES,
    "scheduling_policy": SCHEDULING_POLICIES,
}


def _arg(default, help: str):  # the argparse word
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names. LLM(**kwargs) and the CLI flags both come from here."""

    model: str | None = _arg(None, "model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    dtype: str = _arg("auto", "weights and activations dtype ('auto': chosen from the checkpoint and the device)")
    quantization: str = _arg(
        "auto", "weights kept packed on CPU: 'gguf' keeps a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensors (and a quantized "
                "output head) packed; 'int4'/'int8' quantize the projections at load; 'auto' (default): 'gguf' "
                "for a quantized GGUF file on CPU with one rank, else 'none'; 'none': dense weights in --dtype "
                "(the reference path)")
    seed: int = _arg(0, "random seed for dummy weights and unseeded sampling")
    max_model_len: int | None = _arg(None, "context length (default: the model's)")
    max_num_seqs: int = _arg(256, "most requests in one batch")
    max_num_batched_tokens: int | None = _arg(
        None, "most tokens in one step (default: 2048, or max_model_len without chunked prefill)")
    scheduling_policy: str = _arg(
        "fcfs", "'fcfs' (default): requests run in arrival order, and a request's priority must be 0; "
                "'priority': waiting requests run by (priority, arrival), lower first; a waiting request takes "
                "the seat of a running one of a strictly worse priority, and KV pressure preempts the least urgent")
    block_size: int = _arg(16, "tokens per KV-cache block")
    kv_cache_dtype: str = _arg(
        "auto", "what the KV cache holds: 'auto' (default): float16 under packed (quantized) weights on CPU "
                "(half the bytes a decode step's attention reads), else the model's dtype; 'float16', 'bfloat16' "
                "or 'float32' (other than the model's dtype only with the sdpa attention backend)")
    num_kv_blocks: int | None = _arg(None, "KV pool size in blocks, overriding the memory budget")
    kv_cache_memory_bytes: int | None = _arg(None, "KV pool budget in bytes")
    gpu_memory_utilization: float = _arg(
        0.9, "on CUDA, the fraction of the device's memory the engine may use: the KV pool gets what the "
             "weights, the profiled activation peak and the CUDA graphs leave")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    async_scheduling: bool | None = _arg(None, "schedule step N+1 while step N runs (default: on)")
    max_concurrent_batches: int | None = _arg(
        None, "steps in flight (default: 2 with async scheduling, 1 without)")
    executor: str = _arg("mp", "'mp': worker in a separate process; 'uni': worker thread in the engine process")
    load_format: str = _arg("auto", "'dummy': random weights of the model's shape")
    device: str = _arg("auto", "where the model runs")
    num_threads: int | None = _arg(None, "torch threads in the worker (default: chosen by the executor)")
    served_model_name: str | None = _arg(None, "model name reported by the API")
    tokenizer: str | None = _arg(None, "folder holding the tokenizer (default: the model's)")
    revision: str | None = _arg(None, "the Hugging Face model's revision (branch, tag or commit) to use")
    download_dir: str | None = _arg(None, "where Hugging Face models are cached (default: HF_HOME's hub cache)")
    generation_config: str = _arg(
        "auto", "'auto': requests that leave a sampling field unset get the model's generation_config.json "
                "value; 'vllm': vLLM's defaults; or a folder holding a generation_config.json")
    chat_template: str | None = _arg(None, "a Jinja file (or template text) replacing the tokenizer's chat template")
    model_cache: bool = _arg(True, "keep what loading a GGUF file derives (config, tokenizer, converted weights) "
                                   "in $STEPAHEAD_CACHE (default ~/.cache/stepahead), so later starts read only that")
    debug_invariants: bool = _arg(False, "check scheduler invariants after every step (slow)")
    trace: bool = _arg(False, "record a timeline trace of engine and worker events")
    attention_backend: str = _arg(
        "auto", "'triton': paged-attention kernels that read the block table (CUDA); 'sdpa': torch SDPA over "
                "gathered blocks (CPU); 'auto': triton on CUDA, sdpa on CPU")
    enforce_eager: bool = _arg(False, "never replay decode steps as CUDA graphs")
    async_output: bool | None = _arg(
        None, "the worker hands a step's output on before its sampled ids reach the host, resolving it off "
              "its call path (default: on with CUDA)")
    structured_outputs_backend: str = _arg(
        "xgrammar", "grammar backend for structured outputs (JSON schema, regex, choice, EBNF); 'none' refuses "
                    "requests that carry one")
    max_logprobs: int = _arg(20, "the most logprobs and prompt logprobs per token a request may ask for (-1 in a "
                                 "request means the whole vocabulary); -1: no limit")
    tensor_parallel_size: int = _arg(1, "worker ranks each layer is split across (attention heads, MLP, vocabulary)")
    pipeline_parallel_size: int = _arg(
        1, "pipeline stages the layers are split across; that many steps are in flight (one more with async "
           "scheduling)")
    speculative_config: str | dict | None = _arg(
        None, "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
              "(method ngram, prompt_lookup_min/max; or suffix, suffix_decoding_max_tree_depth, "
              "suffix_decoding_max_cached_requests, suffix_decoding_max_spec_factor, suffix_decoding_min_token_prob; as vLLM's)")
    distributed_executor_backend: str | None = _arg(
        None, "how worker ranks run: 'mp' (processes on this machine), 'ray' (a Ray cluster's nodes; pip install "
              "'stepahead[ray]'), 'uni' (one worker thread); overrides --executor (default: --executor, mp)")

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            check_field(value in allowed, name, value, f"must be one of {', '.join(allowed)}")
        check_field(self.max_logprobs >= -1, "max_logprobs", self.max_logprobs, "must be -1 (no limit) or >= 0")
        check_field(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
                    "must be a power of two in [1, 128]")
        check_field(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                    self.gpu_memory_utilization, "must be in (0, 1]")
        check_field(self.max_concurrent_batches is None or self.max_concurrent_batches >= 1,
                    "max_concurrent_batches", self.max_concurrent_batches, "must be >= 1")
        check_field(self.distributed_executor_backend in (None, "mp", "ray", "uni"), "distributed_executor_backend",
                    self.distributed_executor_backend, "must be one of mp, ray, uni")
        world_size = self.parallel_config().world_size
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_user(self.speculative_config)  # refuses what the worker cannot run
            # The sampler rank proposes and sends each step's outcome to the others (worker/sampled_feed.py);
            # a draft model would have to run sharded on every tensor rank of a stage, which it does not.
            check_field(world_size == 1 or spec.method != "draft_model", "speculative_config", self.speculative_config,
                        f"method draft_model runs on one worker rank; tensor_parallel_size={self.tensor_parallel_size}"
                        f" x pipeline_parallel_size={self.pipeline_parallel_size} is not supported with it (the "
                        f"ngram and suffix methods are)")
        check_field(world_size == 1 or self.resolve_executor() != "uni", "distributed_executor_backend",
                    "uni", f"runs one worker in the engine process; tensor_parallel_size={self.tensor_parallel_size} x "
                           f"pipeline_parallel_size={self.pipeline_parallel_size} ranks need mp or ray")

    def resolve_speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.from_user(self.speculative_config)

    def resolve_executor(self) -> str:
        return self.distributed_executor_backend or self.executor

    def parallel_config(self) -> ParallelConfig:
        from stepahead.distributed.layer_partition import partition_from_env

        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, partition_from_env())

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only the frontend resolving a config touches torch here

        return "cuda" if torch.cuda.is_available() else "cpu"

    def create_engine_config(self) -> EngineConfig:
        from stepahead.models.loading.loader import load_model_config

        device = self.resolve_device()
        parallel_config = self.parallel_config()
        model_config = load_model_config(
            self.model, device, dtype=self.dtype, max_model_len=self.max_model_len, load_format=self.load_format,
            seed=self.seed, served_model_name=self.served_model_name, tokenizer=self.tokenizer,
            use_cache=self.model_cache, revision=self.revision, download_dir=self.download_dir,
            generation_config=self.generation_config, chat_template=self.chat_template,
            quantization=quantization_for_ranks(self.quantization, parallel_config))
        check_parallel(parallel_config, model_config, device, self.resolve_executor())
        spec = self.resolve_speculative_config()
        draft_config = None if spec is None or spec.model is None else self.draft_model_config(
            spec.model, model_config, device,
            # gguf keeps a GGUF file's codes: the draft's own file decides, as auto does (int4/int8 apply to both)
            "auto" if self.quantization == "gguf" else self.quantization)
        attention_backend = resolve_attention_backend(self.attention_backend, device)
        cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, model_config, attention_backend)
        max_model_len = model_config.max_model_len
        max_batched = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                         0 if self.enable_chunked_prefill else max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            debug_invariants=self.debug_invariants,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            scheduling_policy=self.scheduling_policy,
        )
        blocks_per_seq = cdiv(max_model_len, self.block_size)
        # No need for more than every sequence at full length.
        max_useful_blocks = self.max_num_seqs * blocks_per_seq + 1
        num_blocks = self.num_kv_blocks
        gpu_memory_utilization = None
        if num_blocks is None and self.kv_cache_memory_bytes is None and device == "cuda":
            # The worker profiles and sizes the pool (worker/kv_memory.py); this is its upper bound.
            num_blocks, gpu_memory_utilization = max_useful_blocks, self.gpu_memory_utilization
        elif num_blocks is None:
            budget = self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES_CPU
            # A draft model keeps its own KV for the same blocks: one block costs both models' bytes.
            bytes_per_token = model_config.kv_bytes_per_token(cache_dtype) + (
                draft_config.kv_bytes_per_token(cache_dtype) if draft_config is not None else 0)
            num_blocks = min(budget // (self.block_size * bytes_per_token), max_useful_blocks)
        check_field(num_blocks - 1 >= blocks_per_seq, "num_kv_blocks", num_blocks,
                    f"must hold one max_model_len ({max_model_len}) sequence: at least {blocks_per_seq + 1} "
                    f"blocks of {self.block_size} tokens (block 0 is reserved); lower max_model_len or raise the pool")
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            cache_dtype=cache_dtype,
            sliding_window=model_config.kv_sliding_window,
        )
        # Every executor and feature stepahead has supports async scheduling (a step holding a grammar
        # defers its sampling instead), so unset means on.
        async_scheduling = True if self.async_scheduling is None else bool(self.async_scheduling)
        # P pipeline stages keep P steps in flight, one more with async scheduling (vLLM's batch queue).
        depth = self.max_concurrent_batches or (parallel_config.pipeline_parallel_size + (1 if async_scheduling else 0))
        return EngineConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
            async_scheduling=async_scheduling,
            max_concurrent_batches=depth,
            executor=self.resolve_executor(),
            device=device,
            num_threads=self.num_threads,
            trace=self.trace,
            attention_backend=attention_backend,
            enforce_eager=self.enforce_eager,
            # One rank only: with more, outputs come back from the sampler rank synchronously. Not with
            # drafts either: the proposer reads each step's verified tokens on the host.
            async_output=(device == "cuda" if self.async_output is None else self.async_output)
            and parallel_config.world_size == 1 and spec is None,
            structured_outputs_backend=self.structured_outputs_backend,
            max_logprobs=self.max_logprobs,
            parallel_config=parallel_config,
            speculative_config=spec,
            draft_model_config=draft_config,
        )

    def draft_model_config(self, path: str, target: ModelConfig, device: str, quantization: str) -> ModelConfig:
        """The draft checkpoint's config, loaded as the target's is (its dtype and max_model_len, the same
        --quantization, where gguf means auto: a GGUF draft stays packed on CPU as a GGUF target does); it
        proposes ids the target verifies, so it must share the target's vocabulary."""
        from stepahead.models.loading.loader import load_model_config

        draft = load_model_config(
            path, device, dtype=target.dtype,
            max_model_len=target.max_model_len, seed=self.seed, use_cache=self.model_cache, revision=self.revision,
            download_dir=self.download_dir, quantization=quantization)
        check_field(draft.vocab_size == target.vocab_size, "speculative_config.model", path,
                    f"has a vocabulary of {draft.vocab_size} tokens, the target model {target.vocab_size}: a draft "
                    "model must share the target's tokenizer")
        return draft


def check_parallel(parallel: ParallelConfig, model_config, device: str, executor: str) -> None:
    """Sizes that do not split the model, or more ranks than this machine's CUDA devices for the mp
    executor (Ray places ranks on the cluster's devices): a ValueError naming the numbers."""
    from stepahead.distributed.layer_partition import layer_partition
    from stepahead.models import registry

    margs = registry.model_args(model_config.architecture, model_config.hf_config)
    registry.family_of(model_config.architecture).check_parallel_sizes(
        margs, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    layer_partition(model_config.num_layers, parallel.pipeline_parallel_size, parallel.pp_layer_partition)
    if device == "cuda" and parallel.world_size > 1 and executor == "mp":
        import torch

        available = torch.cuda.device_count()
        if parallel.world_size > available:
            raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size} x pipeline_parallel_size="
                             f"{parallel.pipeline_parallel_size} needs {parallel.world_size} CUDA devices, "
                             f"{available} visible (NCCL puts one rank on each device)")


def quantization_for_ranks(requested: str, parallel: ParallelConfig) -> str:
    """Packed (quantized) weights are whole-matrix codes, not split by rank: with more than one rank
    'auto' loads dense weights and an explicit quantization is a ValueError."""
    if parallel.world_size == 1 or requested == "none":
        return requested
    if requested != "auto":
        raise ValueError(f"quantization {requested!r} runs on one rank only (tensor_parallel_size="
                         f"{parallel.tensor_parallel_size}, pipeline_parallel_size={parallel.pipeline_parallel_size}); "
                         "use 'auto' or 'none'")
    return "none"


def resolve_kv_cache_dtype(requested: str, model_config, attention_backend: str) -> str:
    """'auto' -> float16 where packed weights run on CPU (llama.cpp's default cache type too): a decode
    step's attention reads half the bytes. Their projections give bfloat16 values, which float16 holds
    exactly in its range but for rope's rounding of K; a bfloat16 cache would round K 8x coarser, and
    flipped the built-in model's first answer. Values beyond float16's range fail the step loudly.
    Else the model's dtype, as vLLM's 'auto'. A cache of another dtype than the model's needs the sdpa
    backend, which widens what it reads (the Triton kernels read the model's dtype)."""
    if requested == "auto":
        packed = model_config.quantization != "none"
        return "float16" if packed and attention_backend == "sdpa" else model_config.dtype
    check_field(requested == model_config.dtype or attention_backend == "sdpa", "kv_cache_dtype", requested,
                f"must be the model's dtype ({model_config.dtype}) with the {attention_backend} attention backend")
    return requested


def resolve_attention_backend(name: str, device: str) -> str:
    """'auto' -> triton on CUDA, sdpa on CPU. Triton on CPU only runs under its interpreter
    (TRITON_INTERPRET=1, set before triton is imported), which the tests use."""
    if name == "auto":
        return "triton" if device == "cuda" else "sdpa"
    if name == "triton" and device == "cpu":
        check_field(os.environ.get("TRITON_INTERPRET") == "1", "attention_backend", name,
                    "needs a CUDA device (on CPU only under TRITON_INTERPRET=1, Triton's slow interpreter)")
    return name


