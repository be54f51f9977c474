"""The draft model proposer (vLLM's "draft_model" method): a second, smaller model with the target's
vocabulary drafts k tokens per request, k forward passes batched across every request that proposes.

Its KV cache is its own, with the target's block ids: a request's draft KV for position p lives in the
same block id the target's does, so the scheduler's allocation, prefix sharing and preemption hold for
it unchanged (a block shared by a prefix hit holds the same tokens at the same positions in both
models). The pool has the target's blocks plus a few scratch blocks per batch row, for draft positions
past the blocks the target has allocated so far; scratch is read only within one call.

The draft's own count of positions whose KV it holds (`DraftTrack.model_computed`) follows the verified
tokens: a call first catches up on every token the request gained since its last call (its prompt, the
accepted drafts, the target's sample), in chunks of at most max_num_batched_tokens, then runs k one-token
passes of the same shape (a decode step the CUDA graphs could capture), each feeding the previous pass's
draft from the device. Greedy rows (and rows that want logprobs) take the draft's argmax; other random
rows draw from q (the draft's logits under the request's sampling settings), a seeded one with its own uniforms
(spec_uniforms.py), and q goes with the drafts to the general rejection rule. Only the real tokens count as computed afterwards; the positions of the drafts
are written again with the verified tokens next time, which is the rollback of rejected drafts. A
resumed request starts from 0 (its blocks are new).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.config import EngineConfig
from stepahead.models.loading.loader import TORCH_DTYPES, load_model
from stepahead.sampling_params import SamplingParams
from stepahead.utils import cdiv
from stepahead.worker.model_setup import new_attention_backend, use_fast_paths
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.sampler import sampling_probs
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata
from stepahead.worker.spec_decode import spec_uniforms
from stepahead.worker.spec_decode.proposer import ProposedDrafts, Proposer
from stepahead.worker.staging import StagingBuffer, step_capacity


@dataclass
class _Row:
    """One request's tokens in one draft forward pass."""

    start: int  # first position fed
    token_ids: list[int] | None  # fed from the host; None: the previous pass's draft, from the device
    table: list[int]  # block ids: the target's, then this call's scratch blocks
    sample: bool  # whether its last token's logits are drafted from


class DraftModelProposer(Proposer):
    def __init__(self, config: EngineConfig) -> None:
        draft_config = config.draft_model_config
        if draft_config is None:
            raise ValueError("speculative_config method draft_model needs the draft's model config "
                             "(EngineArgs resolves speculative_config.model into it)")
        sched, cache = config.scheduler_config, config.cache_config
        self.device = torch.device(config.device)
        self.model = load_model(draft_config, config.device)
        use_fast_paths(self.model, config, self.device, TORCH_DTYPES[draft_config.dtype])
        self.config = draft_config
        self.cache_dtype = TORCH_DTYPES[cache.cache_dtype or draft_config.dtype]
        self.block_size = cache.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_seqs = sched.max_num_seqs
        self.catch_up_budget = sched.max_num_batched_tokens  # tokens per catch-up pass
        # Draft positions reach k - 1 past a request's tokens: that many blocks past its table, one more
        # where the last token's own block is not allocated yet.
        self.scratch_per_row = cdiv(sched.num_speculative_tokens, self.block_size) + 1
        max_blocks = cdiv(sched.max_model_len, self.block_size)
        rows = sched.max_num_seqs
        self.staging = StagingBuffer(step_capacity(self.catch_up_budget, rows, max_blocks), self.device)
        # stage and finish, as the runner's backend
        self.attention: Any = new_attention_backend(config, self.block_size, max_blocks, self.catch_up_budget,
                                                    self.device, self.model.cpu_kernels)
        self.kv_cache: PagedKVCache | None = None
        self.first_scratch_block = 0

    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token(str(self.cache_dtype).removeprefix("torch."))

    def allocate_kv(self, num_blocks: int) -> None:
        """The draft's pool: the target's num_blocks block ids, then the scratch blocks."""
        self.first_scratch_block = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_row
        self.kv_cache = PagedKVCache(len(self.model.layers), total, self.block_size, self.model.shard.num_kv_heads,
                                     self.config.head_dim, self.cache_dtype, self.device)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], max_drafts: list[int]) -> ProposedDrafts:
        # Never draft a position at or past max_model_len.
        wants = [min(n, self.max_model_len - len(s.token_ids)) for s, n in zip(states, max_drafts, strict=True)]
        active = [i for i, n in enumerate(wants) if n > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not active:
            return ProposedDrafts(drafts)
        if self.kv_cache is None:
            raise RuntimeError("the draft model's KV cache is not allocated (allocate_kv)")
        tables = {}
        for slot, i in enumerate(active):
            first = self.first_scratch_block + slot * self.scratch_per_row
            tables[i] = states[i].block_ids + list(range(first, first + self.scratch_per_row))
        self._catch_up([(states[i], tables[i]) for i in active])
        # The k passes: the last known token, then each draft, one token per request; rows sorted by
        # context length as the decode kernels group them (the same order every pass).
        order = sorted(active, key=lambda i: len(states[i].token_ids))
        num_passes = max(wants[i] for i in order)
        # Random rows without logprobs draw their drafts from q: the draft's logits under the request's
        # temperature, top-k, top-p, min-p and bias (not its output penalties, which would need each pass's
        # drafts on the host), kept for the general rejection rule; the others take the argmax (one-hot q).
        drawing = [row for row, i in enumerate(order) if _draws(states[i].sampling_params)]
        drawn = torch.tensor(drawing, dtype=torch.long, device=self.device)
        draw_md = None
        if drawing:
            draw_md = SamplingMetadata.from_rows(
                [RowSampling(states[order[r]].sampling_params, states[order[r]].prompt_token_ids, [], [], 0)
                 for r in drawing], self.config.vocab_size, self.device)
        previous: torch.Tensor | None = None
        passes, probs = [], []
        for j in range(num_passes):
            rows = [_Row(len(states[i].token_ids) - 1 + j, [states[i].token_ids[-1]] if j == 0 else None,
                         tables[i], True) for i in order]
            logits = self._forward(rows, previous)
            previous = logits.argmax(dim=1)
            if draw_md is not None:
                q = sampling_probs(logits.index_select(0, drawn), draw_md)
                u = spec_uniforms.uniforms([states[order[r]].sampling_params for r in drawing],
                                           [len(states[order[r]].output_token_ids) + j for r in drawing],
                                           spec_uniforms.DRAFT, self.device)
                c = q.cumsum(dim=1)
                pick = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(1), right=True).squeeze(1)
                previous.index_copy_(0, drawn, pick.clamp_(max=q.shape[1] - 1))
                probs.append(q)
            passes.append(previous)
        proposed = torch.stack(passes, dim=1).tolist()  # [len(order), num_passes]: the one read to the host
        draft_probs: list[torch.Tensor | None] = [None] * len(states)
        for row, i in enumerate(order):
            drafts[i] = proposed[row][:wants[i]]
        if drawing:
            stacked = torch.stack(probs, dim=1)  # [len(drawing), num_passes, vocab]
            for k, row in enumerate(drawing):
                draft_probs[order[row]] = stacked[k, :wants[order[row]]]
        for i in active:
            state = states[i]
            # Real tokens only; the last one's KV counts only where it went to a block of the request's own.
            state.draft.model_computed = min(len(state.token_ids), len(state.block_ids) * self.block_size)
        return ProposedDrafts(drafts, draft_probs)

    def _catch_up(self, requests: list[tuple[CachedRequestState, list[int]]]) -> None:
        """Feed every request's tokens from its draft count up to (not including) its last token, in
        passes of at most catch_up_budget tokens."""
        pending = []
        for state, table in requests:
            start = min(state.draft.model_computed, len(state.token_ids) - 1)
            if start < len(state.token_ids) - 1:
                pending.append((state, table, start))
        while pending:
            budget, rows, rest = self.catch_up_budget, [], []
            for state, table, start in pending:
                end = min(len(state.token_ids) - 1, start + budget)
                if end > start:
                    rows.append(_Row(start, state.token_ids[start:end], table, False))
                    budget -= end - start
                if end < len(state.token_ids) - 1:
                    rest.append((state, table, end))
            self._forward(rows, None)
            pending = rest

    def _forward(self, rows: list[_Row], previous: torch.Tensor | None) -> torch.Tensor:
        """One draft forward pass; returns the float32 logits of every sampling row, in row order. Rows
        whose token_ids is None feed `previous` (one id per row, in the same order)."""
        assert self.kv_cache is not None
        staging, bs = self.staging, self.block_size
        staging.reset()
        lengths = [1 if row.token_ids is None else len(row.token_ids) for row in rows]
        num_tokens = sum(lengths)
        ids, ids_offset = staging.alloc(num_tokens)
        positions, positions_offset = staging.alloc(num_tokens)
        slots, slots_offset = staging.alloc(num_tokens)
        # Single-token rows first, by context length (the SDPA path groups them), then the longer ones.
        ordered = sorted(range(len(rows)), key=lambda r: (lengths[r] > 1, rows[r].start if lengths[r] == 1 else 0))
        batch_rows, token_of_row, offset = [], [0] * len(rows), 0
        for r in ordered:
            row, n = rows[r], lengths[r]
            ids[offset:offset + n] = row.token_ids if row.token_ids is not None else -1
            p = np.arange(row.start, row.start + n)
            positions[offset:offset + n] = p
            slots[offset:offset + n] = np.asarray(row.table)[p // bs] * bs + p % bs
            batch_rows.append(BatchRow(offset, n, row.start, row.table))
            token_of_row[r] = offset + n - 1
            offset += n
        sampled = [r for r in range(len(rows)) if rows[r].sample]
        host_logits, logits_offset = staging.alloc(len(sampled))
        host_logits[:] = [token_of_row[r] for r in sampled]
        fed = [r for r in range(len(rows)) if rows[r].token_ids is None]
        host_fed, fed_offset = staging.alloc(len(fed))
        host_fed[:] = [token_of_row[r] for r in fed]
        num_decode_rows = sum(1 for n in lengths if n == 1)
        staged = self.attention.stage(batch_rows, num_decode_rows, staging)
        staging.upload()
        input_ids = staging.view(ids_offset, num_tokens)
        if fed:
            if previous is None or previous.shape[0] != len(fed):
                raise RuntimeError(f"{len(fed)} draft rows to feed, {0 if previous is None else previous.shape[0]} ids")
            input_ids.index_copy_(0, staging.view(fed_offset, len(fed)), previous)
        meta = self.attention.finish(staged, staging.view(slots_offset, num_tokens), staging)
        hidden = self.model(input_ids, staging.view(positions_offset, num_tokens), self.kv_cache, meta)
        if not sampled:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden.index_select(0, staging.view(logits_offset, len(sampled)))).float()


def _draws(params: SamplingParams) -> bool:
    """Whether a request's drafts are drawn at random (from q) rather than taken greedily."""
    return not params.is_greedy and params.top_k != 1 and params.logprobs is None
