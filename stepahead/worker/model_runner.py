"""ModelRunner: the worker's per-request state, step inputs, forward pass and sampling.

The runner keeps per-request state and applies the scheduler's diffs (docs/design.md, "The
scheduler-worker contract"). The token each request sampled last step stays on the device
(`prev_sampled_token_ids`) and is scattered into the next step's input ids, so with async scheduling the
host never waits for it; the sync scheduler sends the same diffs and goes through the same path.

A step is two calls: execute_model (apply diffs, build inputs, forward) and sample_tokens (logits,
sampling), so the engine can defer sampling until a grammar's bitmask is known. The runner orchestrates;
the work is in step_inputs.py (laying a step out), cuda_graphs.py (capture and replay), step_sampling.py
and row_failures.py (what sampling reads, and a failing row apart), spec_decode/ (drafts) and
step_output.py (the step's ModelRunnerOutput).
"""

from __future__ import annotations

import logging
import time

import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.config import EngineConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.distributed import comm
from stepahead.distributed.state import SINGLE, ParallelState
from stepahead.models.loading.loader import TORCH_DTYPES, load_model
from stepahead.tracing import TraceEvent
from stepahead.utils import cdiv
from stepahead.worker import kv_memory
from stepahead.worker.async_output import AsyncModelRunnerOutput
from stepahead.worker.cuda_graphs import capture_decode_graphs
from stepahead.worker.model_setup import new_attention_backend, use_fast_paths
from stepahead.worker.prompt_logprobs import compute_prompt_logprobs
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.row_failures import sample_batch
from stepahead.worker.sampled_feed import SampledTokenFeed
from stepahead.worker.sampling_metadata import RowSampling
from stepahead.worker.spec_decode.spec_decoder import SpecDecoder, make_proposer
from stepahead.worker.staging import StagingBuffer, step_capacity
from stepahead.worker.step_inputs import StepInputBuilder, StepInputs
from stepahead.worker.step_output import StepOutputs, StepState, trace_args
from stepahead.worker.step_sampling import apply_grammar_bitmask, row_sampling

logger = logging.getLogger(__name__)


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
        use_fast_paths(self.model, config, self.device, self.dtype)
        self.vocab_size = model_config.vocab_size
        self.eos_token_ids = [i for i in (model_config.eos_token_id, *model_config.extra_eos_token_ids) if i is not None]
        max_blocks_per_seq = cdiv(sched_config.max_model_len, cache_config.block_size)
        # A request verifying drafts is 1 + k attention rows.
        max_rows = sched_config.max_num_seqs * (1 + sched_config.num_speculative_tokens)
        self.staging = StagingBuffer(step_capacity(sched_config.max_num_batched_tokens, max_rows, max_blocks_per_seq),
                                     self.device)
        self.attention_backend = new_attention_backend(config, self.block_size, max_blocks_per_seq,
                                                       sched_config.max_num_batched_tokens, self.device,
                                                       self.model.cpu_kernels)
        self.num_kv_blocks = kv_memory.pool_blocks(self, max_blocks_per_seq)  # the pool's size, reported to the engine
        self.kv_cache = self.new_kv_cache(self.num_kv_blocks)
        if self.spec is not None:
            self.spec.allocate_kv(self.num_kv_blocks)
        # Decode-only steps replay a captured forward pass where they can (cuda_graphs.py).
        self.decode_graphs = capture_decode_graphs(config, ps, self.model, self.kv_cache, max_blocks_per_seq,
                                                   self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # The last step's sampled tokens, on the device, and the row of each request in it.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_row: dict[str, int] = {}
        self.inputs = StepInputBuilder(self.staging, self.attention_backend, self.block_size, self.device,
                                       self.model.dense_prompt_rows, self.spec)
        self.outputs = StepOutputs(config.trace, ps, self.device)
        self._step: StepState | None = None
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

    # ---- the first call: inputs and the forward pass ----

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
        args = trace_args(self.ps, scheduler_output.step_id, len(inputs.req_ids),
                          scheduler_output.total_num_scheduled_tokens)
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
        self._step = StepState(scheduler_output.step_id, inputs.req_ids, inputs.sample_rows, hidden,
                               scheduler_output.total_num_scheduled_tokens, t0, events, inputs.gpu_start,
                               prompt_logprobs, inputs.sample_drafts)
        return None

    def _take_sampled_tokens(self, scheduler_output: SchedulerOutput) -> None:
        """A rank that does not sample applies the broadcast tokens this step's requests need."""
        cached = scheduler_output.scheduled_cached_reqs
        touched = [*scheduler_output.num_scheduled_tokens, *scheduler_output.finished_req_ids, *cached.req_ids]
        applied = self.feed.apply_through(touched)
        if applied is not None:
            self.prev_sampled_token_ids, self.prev_req_id_to_row = applied

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        return self.inputs.prepare(scheduler_output, self.requests, self.prev_req_id_to_row,
                                   self.prev_sampled_token_ids)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token: a graph replay for a decode-only step that fits one."""
        if self.decode_graphs is not None:
            replayed = self.decode_graphs.replay(inputs)
            if replayed is not None:
                return replayed
        if self._recv_hidden is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata,
                              prompt_rows=inputs.prompt_rows)
        hidden = self._recv_hidden[:inputs.input_ids.shape[0]]  # received from the previous stage in execute_model
        return self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn_metadata, hidden,
                          inputs.prompt_rows)

    def _resolve_outputs(self, keep_latest: bool = False) -> None:
        """Wait for earlier steps' async outputs, so every -1 in the token lists is filled. With
        keep_latest the last step's stays pending: a row that continues from it reads that token from
        prev_sampled_token_ids on the device, and any older one has long left the GPU."""
        pending = self._unresolved[:-1] if keep_latest else self._unresolved
        for handle in pending:
            handle.get_output()
        self._unresolved = [h for h in self._unresolved if not h.resolved]

    # ---- the second call: sampling and the step's output ----

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model that ran a forward")
        t0 = time.monotonic()
        states = [self.requests[step.req_ids[b]] for b in step.sample_rows]
        if self.feed is not None and not self.ps.is_sampler:
            return self._follow_sampler(step, states)
        logits = self.model.compute_logits(step.hidden).float()
        if any(state.sampling_params.reads_output_history for state in states):
            self._resolve_outputs()  # penalties and bad words read every earlier output id
        rows = [row_sampling(state, self.eos_token_ids) for state in states]
        max_accepted = None
        if grammar_output is not None and grammar_output.grammar_bitmask is not None:
            t_mask = time.monotonic()
            max_accepted = apply_grammar_bitmask(logits, step, grammar_output)
            if self.config.trace:
                step.events.append(TraceEvent("apply_bitmask", "worker", t_mask, time.monotonic(),
                                              {"step": step.step_id,
                                               "reqs": len(grammar_output.structured_output_request_ids)}))
        if step.sample_drafts is not None:
            return self._verify_and_propose(step, logits, states, rows, t0, max_accepted)
        metadata, sampled, apart = sample_batch(logits, rows, self.device)
        self.prev_sampled_token_ids = sampled.sampled_token_ids
        if self.feed is not None:
            self.feed.send(sampled.sampled_token_ids)
        self.prev_req_id_to_row = {step.req_ids[b]: i for i, b in enumerate(step.sample_rows)}
        if not self.async_output or apart is not None:
            ids = sampled.sampled_token_ids.tolist()
            for state, token in zip(states, ids, strict=True):
                state.token_ids.append(token)
            out = self.outputs.build(step, metadata, t0, time.monotonic(), ids, sampled, apart)
            return self.outputs.time_on_device(out, step)
        handle = self.outputs.deferred(step, metadata, t0, sampled, states)
        self._unresolved.append(handle)
        return handle

    def _follow_sampler(self, step: StepState, states: list[CachedRequestState]) -> ModelRunnerOutput:
        """A rank that does not sample: its share of the logits, and the sampler's tokens expected by
        broadcast (worker/sampled_feed.py)."""
        if self.ps.is_last_stage:
            self.model.compute_logits(step.hidden)  # its part of the tensor ranks' all-gather
        num_drafts = None if step.sample_drafts is None else [len(d) for d in step.sample_drafts]
        self.feed.expect(states, [step.req_ids[b] for b in step.sample_rows], num_drafts)
        out = ModelRunnerOutput.empty()
        if self.config.trace and self.ps.tp_rank == 0:  # the stage's lane (the executor forwards it)
            out.trace_events = step.events
        return out

    def _verify_and_propose(self, step: StepState, logits: torch.Tensor, states: list[CachedRequestState],
                            rows: list[RowSampling], t0: float,
                            max_accepted: dict[int, int] | None) -> ModelRunnerOutput:
        """Speculative decoding's sampling (worker/spec_decode/spec_decoder.py): every position sampled, the
        drafts verified (a grammar's as far as its masks reach), the next drafts proposed; the verified
        tokens are on the host afterwards."""
        assert self.spec is not None and step.sample_drafts is not None
        verified, proposals = self.spec.verify_and_propose(logits, rows, states, step.sample_drafts, max_accepted,
                                                           self.feed)
        self.prev_req_id_to_row = {}  # nothing to substitute on the device: the host holds every token
        out = self.outputs.account(self.spec.to_output(step.req_ids, step.sample_rows, verified, proposals), step,
                                   t0, time.monotonic())
        self.spec.record_step(step.num_tokens, step.sample_drafts, out.busy_s)
        return self.outputs.time_on_device(out, step)
