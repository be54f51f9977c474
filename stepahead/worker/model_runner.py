"""ModelRunner: the worker's per-request state, step inputs, forward pass and sampling.

The runner keeps per-request state and applies the scheduler's diffs (docs/design.md, "The
scheduler-worker contract"). The token each request sampled last step stays on the device
(`prev_sampled_token_ids`) and is scattered into the next step's input ids, so with async scheduling the
host never waits for it; the sync scheduler sends the same diffs and goes through the same path.

A step is two calls: execute_model (apply diffs, build inputs, forward) and sample_tokens (logits,
sampling), so the engine can defer sampling until a grammar's bitmask is known.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.attention.sdpa import SdpaBackend
from stepahead.attention.triton_backend import TritonBackend
from stepahead.config import EngineConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.distributed import comm
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.models import onednn_linear
from stepahead.models.loading.loader import TORCH_DTYPES, load_model
from stepahead.models.quant.prompt_rows import ALL_PROMPT_ROWS, PromptRows
from stepahead.tracing import TraceEvent
from stepahead.utils import cdiv
from stepahead.worker import kv_memory
from stepahead.worker.async_output import AsyncModelRunnerOutput, copy_to_host
from stepahead.worker.cuda_graphs import DecodeBatch, DecodeGraphs
from stepahead.worker.prompt_logprobs import StepPromptLogprobs, compute_prompt_logprobs
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.row_failures import RowsApart, sample_rows_apart
from stepahead.worker.sampled_feed import SampledTokenFeed
from stepahead.worker.sampler import SamplerOutput, apply_bitmask, logprobs_to_host, sample
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.spec_decode.spec_decoder import SpecDecoder, first_positions, make_proposer
from stepahead.worker.spec_decode.step_outcome import encode_outcomes
from stepahead.worker.staging import StagingBuffer

logger = logging.getLogger(__name__)
STAGING_ALIGNMENT_SLACK = 64  # each staging region starts 16-byte aligned: at most one slot lost per region

@dataclass
class StepInputs:
    """Everything one forward pass reads, as device tensors, plus where the sampling rows are."""

    req_ids: list[str]  # batch order
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: object  # the attention backend's metadata for this step
    sample_rows: list[int]  # batch index of each row that samples (partial prefills excluded)
    logits_indices: torch.Tensor  # [num_sample_rows]: the token of each sampling row
    max_query_len: int  # the most new tokens of any row (1: a decode-only step)
    prompt_rows: PromptRows | None = None  # with packed weights: the rows that are prompt tokens
    gpu_start: torch.cuda.Event | None = None  # recorded just before the upload (CUDA)
    sample_drafts: list[list[int]] | None = None  # with speculation: each sampling row's drafts


@dataclass
class _TokenLayout:
    """Host-side result of laying out a step's tokens in the staging buffer."""

    rows: list[BatchRow]
    num_decode_rows: int
    ids_offset: int
    positions_offset: int
    slots_offset: int
    sample_rows: list[int]
    logits_indices: list[int]
    substitute_at: list[int]  # token index in the batch whose id is this worker's last sample...
    substitute_from: list[int]  # ...taken from this row of prev_sampled_token_ids
    prompt_tokens: list[tuple[int, int]]  # [start, end) runs of prompt tokens in the batch
    sample_drafts: list[list[int]] | None = None  # with speculation: the drafts each sampling row verifies


@dataclass
class _StagedPromptRows:
    """Where _stage_prompt_rows put the prompt and generated row indices in the staging buffer
    (offsets None: every row is a prompt token)."""

    index_offset: int | None
    others_offset: int | None
    num_prompt: int
    num_others: int

    def finish(self, staging) -> PromptRows:
        if self.index_offset is None:
            return ALL_PROMPT_ROWS
        return PromptRows(staging.view(self.index_offset, self.num_prompt),
                          staging.view(self.others_offset, self.num_others))


@dataclass
class _StepState:
    """What execute_model leaves for sample_tokens."""

    step_id: int
    req_ids: list[str]  # batch order
    sample_rows: list[int]
    hidden: torch.Tensor | None  # [num_sample_rows, hidden]; None on a pipeline stage before the last
    num_tokens: int
    t_start: float
    events: list[TraceEvent]
    gpu_start: torch.cuda.Event | None  # recorded just before the step's upload, its first device work (CUDA)
    prompt_logprobs: StepPromptLogprobs | None = None  # for requests that asked (worker/prompt_logprobs.py)
    sample_drafts: list[list[int]] | None = None  # with speculation: each sampling row's drafts (logits per position)


class ModelRunner:
    """Owns the model, the KV cache and the worker's view of every running request.

    Guarantees: it computes exactly the tokens the SchedulerOutput names, at the positions and KV slots
    the scheduler allocated; it fails loudly (RuntimeError) when its state and the scheduler's disagree
    rather than computing on tokens it does not hold.
    """

    def __init__(self, config: EngineConfig, ps: ParallelState = SINGLE) -> None:
        self.config = config
        # This rank's place among tensor and pipeline ranks (docs/design.md, "Tensor and pipeline parallelism").
        self.ps = ps
        model_config, cache_config, sched_config = config.model_config, config.cache_config, config.scheduler_config
        spec_config = config.speculative_config
        if sched_config.num_speculative_tokens and spec_config is None:  # drafts nothing here would propose
            raise ValueError(f"num_speculative_tokens must be 0 without a speculative_config, got "
                             f"{sched_config.num_speculative_tokens}")
        if spec_config is not None and spec_config.method == "draft_model" and ps.world_size > 1:
            raise ValueError(f"speculative_config method draft_model runs on one worker rank, not {ps.world_size}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(model_config.seed)
        self.device = torch.device(config.device)
        self.dtype = TORCH_DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        self.model = load_model(model_config, config.device, ps)
        # Drafts proposed here after sampling and verified in the next forward pass (worker/spec_decode/); a
        # draft model loads here, before the KV pool is sized around both models. Only the sampler rank
        # proposes: the others take its drafts with each step's outcome (worker/sampled_feed.py).
        self.spec = None if spec_config is None else \
            SpecDecoder(spec_config, make_proposer(config) if ps.is_sampler else None)
        if onednn_linear.available(self.device, self.dtype):
            self.model.use_onednn()
        if self.device.type == "cuda" and config.attention_backend == "triton":
            self.model.use_triton_fused()  # norms and rope as fused Triton kernels (attention/triton_fused.py)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = [i for i in (model_config.eos_token_id, *model_config.extra_eos_token_ids) if i is not None]
        max_blocks_per_seq = cdiv(sched_config.max_model_len, cache_config.block_size)
        # Worst step: 6 per token (ids, positions, slots, prompt/generated row index, the decode kernel's
        # keys per token and token-to-request index), block tables of every row, 6 per row. A request
        # verifying drafts is 1 + k attention rows.
        max_rows = sched_config.max_num_seqs * (1 + sched_config.num_speculative_tokens)
        capacity = (6 * sched_config.max_num_batched_tokens + 6 * max_rows + 1
                    + 2 * max_rows * max_blocks_per_seq + STAGING_ALIGNMENT_SLACK)
        self.staging = StagingBuffer(capacity, self.device)
        if config.attention_backend == "triton":
            self.attention_backend = TritonBackend(self.block_size)
        else:
            arange = torch.arange(max_blocks_per_seq * cache_config.block_size + sched_config.max_num_batched_tokens,
                                  device=self.device)
            self.attention_backend = SdpaBackend(self.block_size, max_blocks_per_seq, arange,
                                                 decode_kernel=self.model.cpu_kernels)
        self.num_kv_blocks = cache_config.num_blocks  # the pool's size, reported to the engine
        if cache_config.gpu_memory_utilization is not None:
            self.num_kv_blocks = kv_memory.blocks_from_memory(self, cache_config.gpu_memory_utilization,
                                                              max_blocks_per_seq)
            if ps.world_size > 1:  # every rank holds the same block ids: the smallest pool fits all
                blocks = torch.tensor([self.num_kv_blocks], device=self.device)
                torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN, group=ps.world_group)
                self.num_kv_blocks = int(blocks.item())
        elif self.device.type == "cuda":  # compile the kernels a prefill uses before the first request
            kv_memory.dummy_step(self, min(64, sched_config.max_num_batched_tokens, 2 * sched_config.max_model_len), 2)
        self.kv_cache = self.new_kv_cache(self.num_kv_blocks)
        if self.spec is not None:
            self.spec.allocate_kv(self.num_kv_blocks)
        # Decode-only steps replay a captured forward pass: CUDA with the Triton backend, unless eager
        # or the model waits on the device within a step (experts run one at a time, models/moe.py).
        self.decode_graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and config.attention_backend == "triton" and not config.enforce_eager
                and ps.world_size == 1 and self.model.can_capture_graphs()):
            self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, sched_config.max_num_seqs,
                                              max_blocks_per_seq, self.device)
            self.decode_graphs.capture()
        self.requests: dict[str, CachedRequestState] = {}
        # The last step's sampled tokens, on the device, and the row of each request in it.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_row: dict[str, int] = {}
        self._step: _StepState | None = None
        # Async outputs: sample_tokens returns before the sampled ids reach the host (see async_output.py).
        self.async_output = config.async_output and ps.world_size == 1 and self.spec is None
        self._unresolved: list[AsyncModelRunnerOutput] = []
        # Ranks but one: the sampler's tokens arrive by broadcast (worker/sampled_feed.py).
        self.feed = SampledTokenFeed(ps, self.device, sched_config.num_speculative_tokens) \
            if ps.world_size > 1 else None
        self._recv_hidden: torch.Tensor | None = None  # a later stage's input from the stage before
        if not ps.is_first_stage:
            self._recv_hidden = torch.empty(sched_config.max_num_batched_tokens, self.model.args.hidden_size,
                                            dtype=self.dtype, device=self.device)

    # ---- the KV pool ----

    def new_kv_cache(self, num_blocks: int) -> PagedKVCache:
        """The KV of this rank's layers (its pipeline stage's) and KV heads (its tensor shard)."""
        m = self.config.model_config
        cache_dtype = TORCH_DTYPES[self.config.cache_config.cache_dtype or m.dtype]
        return PagedKVCache(len(self.model.layers), num_blocks, self.block_size, self.model.shard.num_kv_heads,
                            m.head_dim, cache_dtype, self.device)

    # ---- state updates from the scheduler's diffs ----

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            finished = self.requests.pop(req_id, None)
            if finished is not None and self.spec is not None:
                self.spec.finish(finished)
            self.prev_req_id_to_row.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.prompt_token_ids), list(new.block_ids),
                new.num_computed_tokens, new.sampling_params)
            self.prev_req_id_to_row.pop(new.req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            resumed = req_id in cached.resumed_req_ids
            state.num_computed_tokens = (cached.num_computed_tokens[i] if self.spec is None or resumed
                                         else self.spec.num_computed(state, cached.num_computed_tokens[i]))
            new_blocks = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            history = cached.all_token_ids.get(req_id)
            if resumed:
                # Preempted and re-admitted: fresh blocks, history from the scheduler, and whatever this
                # worker sampled (or drafted) before the preemption is no longer ours to feed.
                state.block_ids = list(new_blocks or [])
                state.draft.reset()
                num_outputs = cached.num_output_tokens[i] if i < len(cached.num_output_tokens) else None
                if history is not None:
                    state.set_history(history, num_outputs)
                else:
                    state.token_ids = state.token_ids[: state.num_prompt_tokens + cached.num_output_tokens[i]]
                self.prev_req_id_to_row.pop(req_id, None)
                continue
            if new_blocks:
                state.block_ids.extend(new_blocks)
            if history is not None and len(history) > len(state.token_ids):
                state.set_history(history)
                self.prev_req_id_to_row.pop(req_id, None)  # our last sample is no longer the newest token

    # ---- input preparation ----

    def _batch_order(self, scheduler_output: SchedulerOutput) -> tuple[list[str], int]:
        """Single-token rows first, shortest context first (attention pads them in groups of similar
        length), then multi-token rows. Returns the order and the number of single-token rows. A row
        verifying drafts counts as single: it attends as one decode row per token."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests

        single = {req_id: n == 1 + len(spec_tokens.get(req_id, ())) for req_id, n in num_scheduled.items()}

        def key(req_id: str) -> tuple[bool, int]:
            return (not single[req_id], requests[req_id].num_computed_tokens if single[req_id] else 0)

        order = sorted(num_scheduled, key=key)
        return order, sum(single.values())

    def _lay_out_tokens(self, order: list[str], num_decode_rows: int,
                        scheduler_output: SchedulerOutput) -> _TokenLayout:
        """Token ids, positions and KV slots of every scheduled token, into the staging buffer."""
        block_size, staging = self.block_size, self.staging
        num_tokens = scheduler_output.total_num_scheduled_tokens
        ids, ids_offset = staging.alloc(num_tokens)
        positions, positions_offset = staging.alloc(num_tokens)
        slots, slots_offset = staging.alloc(num_tokens)
        layout = _TokenLayout([], num_decode_rows, ids_offset, positions_offset, slots_offset, [], [], [], [], [],
                              [] if self.spec is not None else None)
        offset = 0
        for b, req_id in enumerate(order):
            state = self.requests[req_id]
            num_new = scheduler_output.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + num_new
            # With speculation a sampling row ends with drafts after the last known token.
            drafts = (self.spec.step_drafts(state, scheduler_output.scheduled_spec_decode_tokens.get(req_id))
                      if self.spec is not None else [])
            token_ids = state.token_ids + drafts if drafts else state.token_ids
            state.num_computed_tokens = end  # the worker's own count (rejected drafts come off at sampling)
            if len(token_ids) < end:
                raise RuntimeError(f"request {req_id}: positions {start}..{end} not known to the worker "
                                   f"(has {len(token_ids)})")
            table = state.block_ids
            need = cdiv(end, block_size)
            if need > len(table):
                raise RuntimeError(f"request {req_id}: {end} tokens need {need} blocks, worker holds {len(table)}")
            # When this row ends at the token our own last sample produced, that token comes from the
            # device copy (on CUDA the host may not have it yet); the host slot gets -1.
            from_device = end == len(token_ids) and req_id in self.prev_req_id_to_row
            if from_device:
                layout.substitute_at.append(offset + num_new - 1)
                layout.substitute_from.append(self.prev_req_id_to_row[req_id])
            if num_new == 1:  # the common decode row: plain ints, no temporary arrays
                ids[offset] = -1 if from_device else state.token_ids[start]
                positions[offset] = start
                slots[offset] = table[start // block_size] * block_size + start % block_size
            else:
                ids[offset:offset + num_new] = token_ids[start:end]
                if from_device:
                    ids[offset + num_new - 1] = -1
                row_positions = np.arange(start, end)
                positions[offset:offset + num_new] = row_positions
                row_blocks = np.asarray(table[start // block_size: need])
                slots[offset:offset + num_new] = (row_blocks[row_positions // block_size - start // block_size]
                                                  * block_size + row_positions % block_size)
            if start < state.num_prompt_tokens:
                layout.prompt_tokens.append((offset, offset + min(end, state.num_prompt_tokens) - start))
            if end >= len(token_ids):
                layout.sample_rows.append(b)
                layout.logits_indices.extend(range(offset + num_new - 1 - len(drafts), offset + num_new))
                if layout.sample_drafts is not None:
                    layout.sample_drafts.append(drafts)
            if drafts:  # one decode row per token: each attends to the keys up to its own (all written first)
                layout.rows.extend(BatchRow(offset + j, 1, start + j, table) for j in range(num_new))
                layout.num_decode_rows += num_new - 1
            else:
                layout.rows.append(BatchRow(offset, num_new, start, table))
            offset += num_new
        return layout

    def _substitute_last_tokens(self, input_ids: torch.Tensor, at: torch.Tensor, source_rows: torch.Tensor) -> None:
        """Fill the -1 placeholders of input_ids with this worker's last sampled tokens, on the device."""
        input_ids.index_copy_(0, at, self.prev_sampled_token_ids.index_select(0, source_rows))

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        staging = self.staging
        staging.reset()
        order, num_decode_rows = self._batch_order(scheduler_output)
        layout = self._lay_out_tokens(order, num_decode_rows, scheduler_output)
        staged_attention = self.attention_backend.stage(layout.rows, layout.num_decode_rows, staging)
        host_logits_indices, logits_offset = staging.alloc(len(layout.logits_indices))
        host_logits_indices[:] = layout.logits_indices
        host_at, at_offset = staging.alloc(len(layout.substitute_at))
        host_at[:] = layout.substitute_at
        host_from, from_offset = staging.alloc(len(layout.substitute_from))
        host_from[:] = layout.substitute_from
        staged_prompt_rows = self._stage_prompt_rows(layout.prompt_tokens, scheduler_output.total_num_scheduled_tokens)
        # The step's device time starts here, not before the host laid the step out: while the host works
        # the GPU waits, and counting that as busy would hide exactly the time GPU utilization is for.
        gpu_start = None
        if self.device.type == "cuda":
            gpu_start = torch.cuda.Event(enable_timing=True)
            gpu_start.record()
        staging.upload()

        num_tokens = scheduler_output.total_num_scheduled_tokens
        input_ids = staging.view(layout.ids_offset, num_tokens)
        if layout.substitute_at:
            self._substitute_last_tokens(input_ids, staging.view(at_offset, len(host_at)),
                                         staging.view(from_offset, len(host_from)))
        attn_metadata = self.attention_backend.finish(staged_attention, staging.view(layout.slots_offset, num_tokens),
                                                      staging)
        return StepInputs(order, input_ids, staging.view(layout.positions_offset, num_tokens), attn_metadata,
                          layout.sample_rows, staging.view(logits_offset, len(host_logits_indices)),
                          max((row.num_new_tokens for row in layout.rows), default=0),
                          staged_prompt_rows.finish(staging) if staged_prompt_rows is not None else None,
                          gpu_start, layout.sample_drafts)

    def _stage_prompt_rows(self, prompt_tokens: list[tuple[int, int]], num_tokens: int) -> _StagedPromptRows | None:
        """Which rows are prompt tokens, for packed projections that run them dense (models/quant/prompt_rows.py);
        None without them or without prompt rows."""
        if not self.model.dense_prompt_rows or not prompt_tokens:
            return None
        is_prompt = np.zeros(num_tokens, dtype=bool)
        for start, end in prompt_tokens:
            is_prompt[start:end] = True
        if is_prompt.all():
            return _StagedPromptRows(None, None, 0, 0)
        prompt = np.flatnonzero(is_prompt)
        others = np.flatnonzero(~is_prompt)
        index, index_offset = self.staging.alloc(len(prompt))
        index[:] = prompt
        rest, others_offset = self.staging.alloc(len(others))
        rest[:] = others
        return _StagedPromptRows(index_offset, others_offset, len(prompt), len(others))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token: a graph replay for a decode-only step that fits one."""
        graphs = self.decode_graphs
        num_tokens = inputs.input_ids.shape[0]
        if graphs is not None and inputs.max_query_len == 1:
            size = graphs.padded_size(num_tokens)
            if size is not None:
                return graphs.run(DecodeBatch(inputs.input_ids, inputs.positions, inputs.attn_metadata), size)
        if self._recv_hidden is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata,
                              prompt_rows=inputs.prompt_rows)
        hidden = self._recv_hidden[:num_tokens]  # received from the previous stage in execute_model
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata, hidden,
                          inputs.prompt_rows)

    def _take_sampled_tokens(self, scheduler_output: SchedulerOutput) -> None:
        """A rank that does not sample applies the broadcast tokens this step's requests need."""
        cached = scheduler_output.scheduled_cached_reqs
        touched = [*scheduler_output.num_scheduled_tokens, *scheduler_output.finished_req_ids, *cached.req_ids]
        applied = self.feed.apply_through(touched)
        if applied is not None:
            self.prev_sampled_token_ids, self.prev_req_id_to_row = applied

    # ---- the two-phase step ----

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        t0 = time.monotonic()
        self._resolve_outputs(keep_latest=True)
        t_tokens = t0
        if self.feed is not None and not self.ps.is_sampler:
            self._take_sampled_tokens(scheduler_output)
            t_tokens = time.monotonic()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        inputs = self._prepare_inputs(scheduler_output)
        t1 = time.monotonic()
        events = []
        args = {"step": scheduler_output.step_id, "num_reqs": len(inputs.req_ids),
                "num_tokens": scheduler_output.total_num_scheduled_tokens}
        if self.ps.pp_size > 1:
            args["stage"] = self.ps.pp_rank  # one timeline lane per pipeline stage (bench/plot.py)
        if self._recv_hidden is not None:  # a later stage waits for the previous stage's hidden states
            comm.recv_hidden(self._recv_hidden[:scheduler_output.total_num_scheduled_tokens], self.ps)
            t_recv = time.monotonic()
            events.append(TraceEvent("wait_hidden", "worker", t1, t_recv, args))
            t1 = t_recv
        hidden = self._forward(inputs)
        prompt_logprobs = None
        if self.ps.is_last_stage:
            prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, inputs.req_ids,
                                                      scheduler_output.num_scheduled_tokens, self.requests)
            hidden = hidden.index_select(0, inputs.logits_indices)
        t2 = time.monotonic()
        prepare = TraceEvent("prepare_inputs", "worker", t_tokens, events[0].start if events else t1, args)
        events = [prepare, *events, TraceEvent("forward", "worker", t1, t2, args)]
        if t_tokens > t0:  # waited for the sampler's tokens of an earlier step
            events.insert(0, TraceEvent("wait_tokens", "worker", t0, t_tokens, args))
        if not self.ps.is_last_stage:  # on to the next stage (returns once the transfer is done)
            comm.send_hidden(hidden, self.ps)
            hidden = None
            events.append(TraceEvent("send_hidden", "worker", t2, time.monotonic(), args))
        self._step = _StepState(scheduler_output.step_id, inputs.req_ids, inputs.sample_rows, hidden,
                                scheduler_output.total_num_scheduled_tokens, t0, events, inputs.gpu_start,
                                prompt_logprobs, inputs.sample_drafts)
        return None

    def _resolve_outputs(self, keep_latest: bool = False) -> None:
        """Wait for earlier steps' async outputs, so every -1 in the token lists is filled. With
        keep_latest the last step's stays pending: a row that continues from it reads that token from
        prev_sampled_token_ids on the device, and any older one has long left the GPU."""
        pending = self._unresolved[:-1] if keep_latest else self._unresolved
        for handle in pending:
            handle.get_output()
        self._unresolved = [h for h in self._unresolved if not h.resolved]

    def _row_sampling(self, state: CachedRequestState) -> RowSampling:
        params = state.sampling_params
        stop_ids: list[int] = []
        if params.min_tokens:
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += self.eos_token_ids
        num_outputs = len(state.token_ids) - state.num_prompt_tokens
        # The output history is copied only for rows whose penalties or bad words read it.
        outputs = state.output_token_ids if params.reads_output_history else []
        return RowSampling(params, state.prompt_token_ids, outputs, stop_ids, num_outputs)

    def _apply_grammar_bitmask(self, logits: torch.Tensor, step: _StepState,
                               grammar_output: GrammarOutput) -> dict[int, int]:
        """Mask the logits of the positions whose request has a grammar: one bitmask row per request, or
        with drafts one per position its rows follow (grammar_output.draft_token_ids). Returns, per
        sampling row with drafts, how many of its drafts may be accepted: those the scheduler's rows
        followed and this step verifies alike (a position past them has no exact mask)."""
        drafts = step.sample_drafts
        first = range(len(step.sample_rows)) if drafts is None else first_positions(drafts)
        sample_index = {step.req_ids[b]: i for i, b in enumerate(step.sample_rows)}
        followed = grammar_output.draft_token_ids
        positions: list[int] = []
        rows: list[int] = []
        max_accepted: dict[int, int] = {}
        row = 0
        for k, req_id in enumerate(grammar_output.structured_output_request_ids):
            row_drafts = followed[k] if followed is not None else []
            i = sample_index.get(req_id)
            if i is not None:
                common = 0
                if drafts is not None:
                    while common < min(len(row_drafts), len(drafts[i])) and row_drafts[common] == drafts[i][common]:
                        common += 1
                    max_accepted[i] = common
                positions += range(first[i], first[i] + common + 1)
                rows += range(row, row + common + 1)
            row += 1 + len(row_drafts)
        if positions:
            apply_bitmask(logits, positions, np.asarray(grammar_output.grammar_bitmask)[rows])
        return max_accepted

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model that ran a forward")
        t0 = time.monotonic()
        states = [self.requests[step.req_ids[b]] for b in step.sample_rows]
        if self.feed is not None and not self.ps.is_sampler:
            if self.ps.is_last_stage:
                self.model.compute_logits(step.hidden)  # its part of the tensor ranks' all-gather
            num_drafts = None if step.sample_drafts is None else [len(d) for d in step.sample_drafts]
            self.feed.expect(states, [step.req_ids[b] for b in step.sample_rows], num_drafts)
            out = ModelRunnerOutput.empty()
            if self.config.trace and self.ps.tp_rank == 0:  # the stage's lane (the executor forwards it)
                out.trace_events = step.events
            return out
        logits = self.model.compute_logits(step.hidden).float()
        if any(state.sampling_params.reads_output_history for state in states):
            self._resolve_outputs()  # penalties and bad words read every earlier output id
        rows = [self._row_sampling(state) for state in states]
        max_accepted = None
        if grammar_output is not None and grammar_output.grammar_bitmask is not None:
            t_mask = time.monotonic()
            max_accepted = self._apply_grammar_bitmask(logits, step, grammar_output)
            if self.config.trace:
                step.events.append(TraceEvent("apply_bitmask", "worker", t_mask, time.monotonic(),
                                              {"step": step.step_id,
                                               "reqs": len(grammar_output.structured_output_request_ids)}))
        if step.sample_drafts is not None:
            return self._verify_and_propose(step, logits, states, rows, t0, max_accepted)
        apart = None
        try:
            metadata = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device) if rows else None
            if metadata is not None:
                sampled = sample(logits, metadata)
            else:
                sampled = SamplerOutput(torch.empty(0, dtype=torch.long, device=self.device))
        except Exception as e:  # a row's failure fails its request, not the step
            apart = sample_rows_apart(logits, rows, e)
            metadata, sampled = None, SamplerOutput(torch.tensor(apart.token_ids, dtype=torch.long, device=self.device))
        self.prev_sampled_token_ids = sampled.sampled_token_ids
        if self.feed is not None:
            self.feed.send(sampled.sampled_token_ids)
        self.prev_req_id_to_row = {step.req_ids[b]: i for i, b in enumerate(step.sample_rows)}
        if not self.async_output or apart is not None:
            ids = sampled.sampled_token_ids.tolist()
            for state, token in zip(states, ids, strict=True):
                state.token_ids.append(token)
            out = self._build_output(step, metadata, t0, time.monotonic(), ids, sampled, apart)
            if step.gpu_start is not None:
                out.gpu_busy_s = self._gpu_busy_s(step.gpu_start)
            return out
        host = copy_to_host(sampled)
        ready = gpu_timing = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event(enable_timing=True, blocking=True)  # the resolver sleeps, not spins
            ready.record()
            gpu_timing = (step.gpu_start, ready)
        placeholders = []
        for state in states:
            placeholders.append((state.token_ids, len(state.token_ids)))
            state.token_ids.append(-1)
        # The output is built on the host once the ids arrive (by the executor's resolver thread).
        finish = functools.partial(self._build_output, step, metadata, t0, time.monotonic())
        handle = AsyncModelRunnerOutput(host, ready, placeholders, finish, gpu_timing)
        self._unresolved.append(handle)
        return handle

    def _verify_and_propose(self, step: _StepState, logits: torch.Tensor, states: list[CachedRequestState],
                            rows: list[RowSampling], t0: float,
                            max_accepted: dict[int, int] | None) -> ModelRunnerOutput:
        """Speculative decoding's sampling (worker/spec_decode/spec_decoder.py): every position sampled, the
        drafts verified (a grammar's as far as its masks reach), the next drafts proposed; the verified
        tokens are on the host afterwards."""
        assert self.spec is not None and step.sample_drafts is not None
        verified = self.spec.sample_and_verify(logits, rows, step.sample_drafts,
                                               [state.draft.verifying_probs for state in states], max_accepted)
        proposals = self.spec.propose(states, step.sample_drafts, verified)
        if self.feed is not None:  # the other ranks keep every request's tokens and drafts as this one
            self.feed.send(encode_outcomes(verified.tokens, [state.draft.drafts for state in states],
                                           self.spec.num_speculative_tokens).to(self.device))
        self.prev_req_id_to_row = {}  # nothing to substitute on the device: the host holds every token
        out = self._account(self.spec.to_output(step.req_ids, step.sample_rows, verified, proposals), step, t0,
                            time.monotonic())
        self.spec.record_step(step.num_tokens, step.sample_drafts, out.busy_s)
        if step.gpu_start is not None:
            out.gpu_busy_s = self._gpu_busy_s(step.gpu_start)
        return out

    @staticmethod
    def _gpu_busy_s(gpu_start: torch.cuda.Event) -> float:
        """Device time of a step whose ids were read synchronously, from CUDA events."""
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return gpu_start.elapsed_time(end) / 1000.0

    def _build_output(self, step: _StepState, metadata: SamplingMetadata | None, t0: float, t1: float,
                      ids: list[int], host: SamplerOutput, apart: RowsApart | None = None) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput from its sampled ids and logprob tensors, both on the host
        (or, when the batch's sampling failed, from its rows sampled one at a time)."""
        row_logprobs = {}
        if apart is not None:
            row_logprobs = apart.logprobs
        elif metadata is not None and metadata.max_num_logprobs is not None:
            row_logprobs = logprobs_to_host(host, metadata, ids)
        sampled_token_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs = {}
        for i, b in enumerate(step.sample_rows):
            sampled_token_ids[b] = [ids[i]]
            if i in row_logprobs:
                logprobs[step.req_ids[b]] = [row_logprobs[i]]
        out = ModelRunnerOutput(step.req_ids, sampled_token_ids, logprobs)
        if apart is not None:
            out.failed = {step.req_ids[step.sample_rows[i]]: reason for i, reason in apart.failed.items()}
        return self._account(out, step, t0, t1)

    def _account(self, out: ModelRunnerOutput, step: _StepState, t0: float, t1: float) -> ModelRunnerOutput:
        """The step's busy time, prompt logprobs and trace events on its output."""
        # On CPU the host does the device's work: its time is the device time too (CUDA overrides it).
        out.busy_s = out.gpu_busy_s = t1 - step.t_start
        if step.prompt_logprobs is not None:
            out.prompt_logprobs = step.prompt_logprobs.to_host()
        if self.config.trace:
            args = {"step": step.step_id, "num_reqs": len(step.req_ids), "num_tokens": step.num_tokens}
            if self.ps.pp_size > 1:
                args["stage"] = self.ps.pp_rank
            out.trace_events = step.events + [TraceEvent("sample", "worker", t0, t1, args)]
        return out
