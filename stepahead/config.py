"""The resolved engine configuration: model, scheduler and cache configs and the EngineConfig holding them.

EngineArgs (stepahead.engine.arg_utils) resolves user arguments into these; the core reads only these."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from stepahead.validation import InvalidInputError, check_field

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_KV_CACHE_BYTES_CPU = 2 << 30
# --quantization (models/quant/quantized_loader.py says what each means).
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "int4")
# --kv-cache-dtype (engine/arg_utils.py, resolve_kv_cache_dtype, says what "auto" picks).
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

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
    # A model-cache folder holding the checkpoint converted (config, tokenizer, safetensors weights):
    # loads read it instead of the source (models/loading/model_cache.py).
    converted: str | None = None
    # SamplingParams defaults from the model's generation_config.json (models/loading/generation_config.py).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # replaces the tokenizer's chat template (Jinja text)
    # End tokens beyond eos_token_id (config.json's or generation_config.json's list): they finish
    # requests as EOS does, unless ignore_eos.
    extra_eos_token_ids: tuple[int, ...] = ()
    # "none": dense weights in dtype; "gguf": the GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K tensors kept packed;
    # "int4"/"int8": projections quantized at load (CPU; models/quant/quantized_loader.py). Never "auto".
    quantization: str = "none"
    # Each layer's attention window in tokens (None: the layer attends to the whole context); empty
    # when no layer has one. A token attends to itself and the window - 1 tokens before it.
    sliding_windows: tuple[int | None, ...] = ()

    @property
    def kv_sliding_window(self) -> int | None:
        """The window the KV cache manager returns blocks out of (core/sliding_window.py): set only
        when every layer has a window, since one block table serves every layer, and then the
        largest, since a block may go only when no layer reads it."""
        windows = self.sliding_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    def kv_bytes_per_token(self, cache_dtype: str | None = None) -> int:
        """K and V of one token in every layer, held in cache_dtype (default: the model's dtype)."""
        itemsize = 4 if (cache_dtype or self.dtype) == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: off
    debug_invariants: bool = False  # check the invariants (docs/design.md, "Invariants") after every schedule/update
    # Draft tokens per sampling step (docs/design.md, "Draft tokens as placeholders"); 0: no speculation.
    # EngineArgs sets it from speculative_config; the worker must propose the drafts.
    num_speculative_tokens: int = 0
    # "fcfs": the waiting queue in arrival order; "priority": by (request priority, arrival), lower
    # first, and a running request of a strictly worse priority gives its place (core/waiting_order.py).
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        check_field(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                    f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        check_field(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        check_field(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1")
        check_field(self.max_model_len >= 2, "max_model_len", self.max_model_len, "must be >= 2")
        check_field(self.num_speculative_tokens >= 0, "num_speculative_tokens", self.num_speculative_tokens,
                    "must be >= 0")
        if not self.enable_chunked_prefill:
            check_field(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens", self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is disabled",
            )


# Proposer methods with vLLM's names; those the worker cannot run yet are refused rather than
# accepted and ignored.
SPECULATIVE_METHODS = ("ngram", "draft_model", "suffix")
SUPPORTED_SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "draft_model", "suffix")
DRAFT_POLICIES = ("cost", "acceptance")
# vLLM's n-gram lengths when neither is given; when one is, the other takes its value.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: which proposer drafts, and how many tokens per step."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram: shortest and longest n-gram matched
    prompt_lookup_max: int | None = None
    # No drafts while a step samples this many requests or more (where the forward pass is compute-bound,
    # draft positions cost about what they save); None: always draft.
    disable_by_batch_size: int | None = None
    # How many drafts a request proposes (at most num_speculative_tokens): "acceptance" one more than the
    # request has been accepting; "cost" a position only where its chance of acceptance outweighs what
    # its row costs, measured on recent steps, so drafting stops at batch sizes where it would not pay
    # (worker/spec_decode/draft_track.py, draft_budget.py; docs/BENCHMARKS.md compares them).
    draft_policy: str = "acceptance"
    # draft_model: the draft checkpoint (a folder, a .gguf file or a hub id, as the target's model), loaded
    # by the target's loader with the target's dtype; it must share the target's vocabulary.
    model: str | None = None
    # suffix (vLLM's names and defaults): the tries' depth (bounds match plus draft), how many finished
    # requests' outputs the shared trie keeps (0: none), the draft length per matched token, and the
    # lowest estimated probability a drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        check_field(self.method in SPECULATIVE_METHODS, "speculative_config.method", self.method,
                    f"must be one of {', '.join(SPECULATIVE_METHODS)}")
        check_field(self.method in SUPPORTED_SPECULATIVE_METHODS, "speculative_config.method", self.method,
                    "is not supported yet: the worker has no proposer for it (supported: "
                    f"{', '.join(SUPPORTED_SPECULATIVE_METHODS) or 'none'})")
        check_field(isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
                    "speculative_config.num_speculative_tokens", self.num_speculative_tokens, "must be an int >= 1")
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        check_field((self.model is not None) == (self.method == "draft_model"), "speculative_config.model",
                    self.model, "must name the draft checkpoint for method draft_model, and only for it")
        check_field(self.disable_by_batch_size is None
                    or (isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1),
                    "speculative_config.disable_by_batch_size", self.disable_by_batch_size, "must be an int >= 1")
        check_field(self.draft_policy in DRAFT_POLICIES, "speculative_config.draft_policy", self.draft_policy,
                    f"must be one of {', '.join(DRAFT_POLICIES)}")
        check_field(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                    "speculative_config.prompt_lookup_min", self.prompt_lookup_min, "must be an int >= 1")
        check_field(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= (self.prompt_lookup_min or 1),
                    "speculative_config.prompt_lookup_max", self.prompt_lookup_max,
                    f"must be an int >= prompt_lookup_min ({self.prompt_lookup_min})")

        self._check_suffix_fields()

    def _check_suffix_fields(self) -> None:
        check_field(isinstance(self.suffix_decoding_max_tree_depth, int) and self.suffix_decoding_max_tree_depth >= 2,
                    "speculative_config.suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth,
                    "must be an int >= 2 (a matched token and a drafted one)")
        check_field(isinstance(self.suffix_decoding_max_cached_requests, int)
                    and self.suffix_decoding_max_cached_requests >= 0,
                    "speculative_config.suffix_decoding_max_cached_requests",
                    self.suffix_decoding_max_cached_requests, "must be an int >= 0")
        check_field(isinstance(self.suffix_decoding_max_spec_factor, (int, float))
                    and self.suffix_decoding_max_spec_factor > 0,
                    "speculative_config.suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor,
                    "must be a number > 0")
        check_field(isinstance(self.suffix_decoding_min_token_prob, (int, float))
                    and 0 <= self.suffix_decoding_min_token_prob <= 1,
                    "speculative_config.suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob,
                    "must be a number in [0, 1]")

    @classmethod
    def from_user(cls, given: str | dict) -> SpeculativeConfig:
        """A dict, or its JSON text (the CLI's --speculative-config); unknown keys are refused."""
        value: Any = given
        if isinstance(given, str):
            try:
                value = json.loads(given)
            except json.JSONDecodeError as e:
                raise InvalidInputError(f"speculative_config must be a JSON object, got {given!r}: {e}",
                                        param="speculative_config") from None
        if not isinstance(value, dict):
            raise InvalidInputError(f"speculative_config must be a JSON object, got {value!r}",
                                    param="speculative_config")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        check_field(not unknown, "speculative_config", unknown, f"has unknown keys (known: {', '.join(sorted(names))})")
        for required in ("method", "num_speculative_tokens"):
            check_field(required in value, "speculative_config", value, f"must set {required!r}")
        return cls(**value)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 1024  # including the reserved null block 0
    enable_prefix_caching: bool = True
    # Set on CUDA when no pool size was given: the worker sizes the pool from this fraction of the
    # device's memory (num_blocks is then the most it may use) and reports the size it chose.
    gpu_memory_utilization: float | None = None
    # What the KV cache holds (resolved from --kv-cache-dtype): "float32" | "bfloat16" | "float16";
    # None: the model's dtype.
    cache_dtype: str | None = None
    # Every layer's attention window reaches at most this many tokens back (ModelConfig.kv_sliding_window):
    # blocks wholly before it are returned to the pool. None: some layer attends to the whole context.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        check_field(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        check_field(self.sliding_window is None or self.sliding_window >= 1, "sliding_window", self.sliding_window,
                    "must be >= 1 or None")
        check_field(self.num_blocks >= 2, "num_blocks", self.num_blocks, "must be >= 2 (block 0 is reserved)")


@dataclass
class ParallelConfig:
    """How many worker ranks run the model: tensor_parallel_size x pipeline_parallel_size of them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Each stage's layer count (STEPAHEAD_PP_LAYER_PARTITION); None: vLLM's default split
    # (distributed/layer_partition.py).
    pp_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_field(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        check_field(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", self.pipeline_parallel_size,
                    "must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def sampler_rank(self) -> int:
        """The rank that samples and reports outputs: tensor rank 0 of the last stage (rank = pp * tp + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass
class EngineConfig:
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    async_scheduling: bool
    max_concurrent_batches: int  # batch-queue depth: 2 with async, 1 without, more to study PP
    executor: str  # "mp" | "uni" | "ray"
    device: str  # "cpu" | "cuda"
    num_threads: int | None = None  # torch threads in the worker; None: decided by the executor
    trace: bool = False
    attention_backend: str = "sdpa"  # "sdpa" | "triton", resolved from the device
    enforce_eager: bool = False  # no decode CUDA graphs
    # The worker returns a step's output before its sampled ids reach the host (on CUDA; see
    # worker/async_output.py); the executor resolves it off the worker's call path.
    async_output: bool = False
    # "xgrammar": requests may carry a grammar (structured outputs); "none": such requests are refused.
    structured_outputs_backend: str = "xgrammar"
    # The most logprobs (and prompt logprobs) per token a request may ask for; -1: no limit (vLLM's).
    max_logprobs: int = 20
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    # The drafting method and its settings; None: no speculative decoding (scheduler_config's
    # num_speculative_tokens is then 0).
    speculative_config: SpeculativeConfig | None = None
    # speculative_config.model resolved (method draft_model): the draft's config, in the target's dtype.
    draft_model_config: ModelConfig | None = None
