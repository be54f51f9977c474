"""A step's inputs: the scheduled tokens laid out in the staging buffer and sent to the device in one copy.

Rows go single-token first, shortest context first (attention pads them in groups of similar length),
then multi-token rows. Each token gets its id, position and KV slot; a row ending at the token this
worker sampled last step takes that id from the device copy (`prev_sampled_token_ids`), so with async
scheduling the host never waits for it. With speculation a sampling row ends with the drafts it verifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stepahead.attention.rows import BatchRow
from stepahead.core.sched_output import SchedulerOutput
from stepahead.models.quant.prompt_rows import ALL_PROMPT_ROWS, PromptRows
from stepahead.utils import cdiv
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.spec_decode.spec_decoder import SpecDecoder
from stepahead.worker.staging import StagingBuffer


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

    def finish(self, staging: StagingBuffer) -> PromptRows:
        if self.index_offset is None or self.others_offset is None:
            return ALL_PROMPT_ROWS
        return PromptRows(staging.view(self.index_offset, self.num_prompt),
                          staging.view(self.others_offset, self.num_others))


class StepInputBuilder:
    """Builds each step's StepInputs in the runner's staging buffer, with its attention backend's metadata
    (an SdpaBackend or a TritonBackend: each finishes what it staged).

    dense_prompt_rows: the model's packed projections run prompt rows dense (models/quant/prompt_rows.py),
    so the step says which rows those are. spec: speculative decoding's drafts to lay out, or None."""

    def __init__(self, staging: StagingBuffer, attention_backend: Any, block_size: int,
                 device: torch.device, dense_prompt_rows: bool, spec: SpecDecoder | None) -> None:
        self.staging = staging
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.device = device
        self.dense_prompt_rows = dense_prompt_rows
        self.spec = spec

    def prepare(self, scheduler_output: SchedulerOutput, requests: dict[str, CachedRequestState],
                prev_req_id_to_row: dict[str, int], prev_sampled_token_ids: torch.Tensor | None) -> StepInputs:
        """The step's inputs on the device. prev_req_id_to_row: the row of each request in
        prev_sampled_token_ids, the last step's samples on the device."""
        staging = self.staging
        staging.reset()
        order, num_decode_rows = self._batch_order(scheduler_output, requests)
        layout = self._lay_out_tokens(order, num_decode_rows, scheduler_output, requests, prev_req_id_to_row)
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
        if layout.substitute_at:  # the -1 placeholders get this worker's last samples, on the device
            assert prev_sampled_token_ids is not None  # a row continues from a sample only when there is one
            input_ids.index_copy_(0, staging.view(at_offset, len(host_at)),
                                  prev_sampled_token_ids.index_select(0, staging.view(from_offset, len(host_from))))
        attn_metadata = self.attention_backend.finish(staged_attention, staging.view(layout.slots_offset, num_tokens),
                                                      staging)
        return StepInputs(order, input_ids, staging.view(layout.positions_offset, num_tokens), attn_metadata,
                          layout.sample_rows, staging.view(logits_offset, len(host_logits_indices)),
                          max((row.num_new_tokens for row in layout.rows), default=0),
                          staged_prompt_rows.finish(staging) if staged_prompt_rows is not None else None,
                          gpu_start, layout.sample_drafts)

    @staticmethod
    def _batch_order(scheduler_output: SchedulerOutput, requests: dict[str, CachedRequestState]) -> tuple[list[str], int]:
        """Single-token rows first, shortest context first (attention pads them in groups of similar
        length), then multi-token rows. Returns the order and the number of single-token rows. A row
        verifying drafts counts as single: it attends as one decode row per token."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens

        single = {req_id: n == 1 + len(spec_tokens.get(req_id, ())) for req_id, n in num_scheduled.items()}

        def key(req_id: str) -> tuple[bool, int]:
            return (not single[req_id], requests[req_id].num_computed_tokens if single[req_id] else 0)

        order = sorted(num_scheduled, key=key)
        return order, sum(single.values())

    def _lay_out_tokens(self, order: list[str], num_decode_rows: int, scheduler_output: SchedulerOutput,
                        requests: dict[str, CachedRequestState], prev_req_id_to_row: dict[str, int]) -> _TokenLayout:
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
            state = requests[req_id]
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
            from_device = end == len(token_ids) and req_id in prev_req_id_to_row
            if from_device:
                layout.substitute_at.append(offset + num_new - 1)
                layout.substitute_from.append(prev_req_id_to_row[req_id])
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

    def _stage_prompt_rows(self, prompt_tokens: list[tuple[int, int]], num_tokens: int) -> _StagedPromptRows | None:
        """Which rows are prompt tokens, for packed projections that run them dense (models/quant/prompt_rows.py);
        None without them or without prompt rows."""
        if not self.dense_prompt_rows or not prompt_tokens:
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
