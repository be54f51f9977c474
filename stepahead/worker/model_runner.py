"""ModelRunner: worker-side request state, input preparation, forward and sampling (engine-spec §1.6, §7.12).

The runner keeps per-request state and applies the scheduler's diffs. The token each request sampled
last step stays on the device (`prev_sampled_token_ids`) and is scattered into the next step's input
ids, so with async scheduling the host never waits for it; the sync scheduler sends the same diffs and
goes through the same path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from stepahead.attention.sdpa import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillRow
from stepahead.config import EngineConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.models.loader import load_model
from stepahead.worker.input_batch import CachedRequestState, StagingBuffer
from stepahead.worker.sampler import RowSampling, apply_bitmask, sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_groups(needs: list[int], min_rows: int = 8) -> list[tuple[int, int]]:
    """Split rows sorted by block count into [start, end) groups so that padding a group to its longest
    row at most doubles a row's blocks (groups keep at least min_rows rows: fewer SDPA calls)."""
    groups, start = [], 0
    for i in range(1, len(needs) + 1):
        if i == len(needs) or (needs[i] > 2 * needs[start] and i - start >= min_rows):
            groups.append((start, i))
            start = i
    return groups


@dataclass
class _StepState:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]  # batch order
    sample_rows: list[int]  # batch index of each row that samples (partial prefills excluded)
    hidden: torch.Tensor  # [num_sample_rows, hidden]
    num_tokens: int
    t_start: float
    events: list[dict]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(mc.seed)
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[mc.dtype]
        self.block_size = cc.block_size
        self.model = load_model(mc, config.device)
        self.kv_cache = PagedKVCache(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim,
                                     self.dtype, self.device)
        self.vocab_size = mc.vocab_size
        self.eos_token_id = mc.eos_token_id
        max_nb = -(-sc.max_model_len // cc.block_size)
        # Worst step: 3 per token (ids, positions, slots), block tables of every row, 4 per row.
        cap = 3 * sc.max_num_batched_tokens + 4 * sc.max_num_seqs + 2 * sc.max_num_seqs * max_nb
        self.staging = StagingBuffer(cap, self.device)
        self.arange = torch.arange(max_nb * cc.block_size + sc.max_num_batched_tokens, device=self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # The last step's sampled tokens, on the device, and the row of each request in it.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_row: dict[str, int] = {}
        self._step: _StepState | None = None

    # ---- state updates from the scheduler's diffs ----

    def _new_generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.prev_req_id_to_row.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.requests[nr.req_id] = CachedRequestState(
                nr.req_id, list(nr.prompt_token_ids), list(nr.prompt_token_ids), list(nr.block_ids),
                nr.num_computed_tokens, nr.sampling_params, self._new_generator(nr.sampling_params.seed))
            self.prev_req_id_to_row.pop(nr.req_id, None)
        cd = so.scheduled_cached_reqs
        for i, rid in enumerate(cd.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = cd.num_computed_tokens[i]
            new_blocks = cd.new_block_ids[i] if i < len(cd.new_block_ids) else None
            history = cd.all_token_ids.get(rid)
            if rid in cd.resumed_req_ids:
                # Preempted and re-admitted: fresh blocks, history from the scheduler, and whatever this
                # worker sampled before the preemption is no longer ours to feed.
                st.block_ids = list(new_blocks or [])
                if history is not None:
                    st.set_history(history, cd.num_output_tokens[i] if i < len(cd.num_output_tokens) else None)
                else:
                    st.token_ids = st.token_ids[: st.num_prompt_tokens + cd.num_output_tokens[i]]
                self.prev_req_id_to_row.pop(rid, None)
                continue
            if new_blocks:
                st.block_ids.extend(new_blocks)
            if history is not None and len(history) > len(st.token_ids):
                st.set_history(history)
                self.prev_req_id_to_row.pop(rid, None)  # our last sample is no longer the newest token
            if i < len(cd.new_token_ids) and cd.new_token_ids[i]:
                known = len(st.token_ids)
                st.token_ids.extend(cd.new_token_ids[i][max(0, known - cd.num_computed_tokens[i]):])

    # ---- input preparation ----

    def _prepare_inputs(self, so: SchedulerOutput):
        """Fill the staging buffer and build the step's attention metadata; returns what forward needs."""
        bs = self.block_size
        nst, reqs = so.num_scheduled_tokens, self.requests
        # Single-token rows first, shortest context first (see decode_groups), then multi-token rows.
        order = sorted(nst, key=lambda r: (nst[r] != 1, reqs[r].num_computed_tokens if nst[r] == 1 else 0))
        num_decode = sum(1 for r in order if nst[r] == 1)
        t = so.total_num_scheduled_tokens
        stg = self.staging
        stg.reset()
        ids, ids_off = stg.alloc(t)
        pos, pos_off = stg.alloc(t)
        slots, slot_off = stg.alloc(t)
        sample_rows, logits_idx = [], []
        scatter_dst, scatter_src = [], []
        prefill_specs = []
        offset = 0
        for b, rid in enumerate(order):
            st = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            c = st.num_computed_tokens
            end = c + n
            if len(st.token_ids) < end:
                raise RuntimeError(f"request {rid}: positions {c}..{end} not known to the worker "
                                   f"(has {len(st.token_ids)})")
            # When this row ends at the token our own last sample produced, that token comes from the
            # device copy (on CUDA the host may not have it yet); the host slot gets -1.
            from_device = end == len(st.token_ids) and rid in self.prev_req_id_to_row
            if from_device:
                scatter_dst.append(offset + n - 1)
                scatter_src.append(self.prev_req_id_to_row[rid])
            table = st.block_ids
            need = -(-end // bs)
            if need > len(table):
                raise RuntimeError(f"request {rid}: {end} tokens need {need} blocks, worker holds {len(table)}")
            if n == 1:  # the common decode row: plain ints, no temporary arrays
                ids[offset] = -1 if from_device else st.token_ids[c]
                pos[offset] = c
                slots[offset] = table[c // bs] * bs + c % bs
            else:
                ids[offset:offset + n] = st.token_ids[c:end]
                if from_device:
                    ids[offset + n - 1] = -1
                p = np.arange(c, end)
                pos[offset:offset + n] = p
                slots[offset:offset + n] = np.asarray(table[c // bs: need])[p // bs - c // bs] * bs + p % bs
            if end >= len(st.token_ids):
                sample_rows.append(b)
                logits_idx.append(offset + n - 1)
            if n != 1:
                prefill_specs.append((offset, offset + n, c, need))
            offset += n
        # Decode block tables (padded with null block 0, per group) and context lengths.
        lens, lens_off = stg.alloc(num_decode)
        needs = []
        for b in range(num_decode):
            lens[b] = reqs[order[b]].num_computed_tokens + 1
            needs.append(-(-int(lens[b]) // bs))
        group_tables = []
        for a, e in decode_groups(needs):
            nb = needs[e - 1]
            bt, bt_off = stg.alloc((e - a) * nb)
            bt[:] = 0
            for b in range(a, e):
                bt[(b - a) * nb:(b - a) * nb + needs[b]] = reqs[order[b]].block_ids[:needs[b]]
            group_tables.append((a, e, nb, bt_off))
        # Block tables of multi-token rows with a cached prefix (the others attend only to themselves).
        pf_tables = []
        for b, (_s, _e, c, need) in zip(range(num_decode, len(order)), prefill_specs, strict=True):
            if c == 0:
                pf_tables.append(None)
                continue
            tb, tb_off = stg.alloc(need)
            tb[:] = self.requests[order[b]].block_ids[:need]
            pf_tables.append((tb_off, need))
        li, li_off = stg.alloc(len(logits_idx))
        li[:] = logits_idx
        sd, sd_off = stg.alloc(len(scatter_dst))
        sd[:] = scatter_dst
        ss, ss_off = stg.alloc(len(scatter_src))
        ss[:] = scatter_src
        stg.upload()

        input_ids = stg.view(ids_off, t)
        if scatter_dst:
            input_ids.index_copy_(0, stg.view(sd_off, len(sd)),
                                  self.prev_sampled_token_ids.index_select(0, stg.view(ss_off, len(ss))))
        groups = []
        for a, e, nb, bt_off in group_tables:
            keys = self.arange[: nb * bs]
            mask = (keys.unsqueeze(0) < stg.view(lens_off + a, e - a).unsqueeze(1)).view(1, e - a, 1, nb * bs)
            groups.append(DecodeGroup(a, e, stg.view(bt_off, (e - a) * nb, (e - a, nb)), mask))
        prefills = []
        for (s, e, c, _need), tb in zip(prefill_specs, pf_tables, strict=True):
            if tb is None:
                prefills.append(PrefillRow(s, e, 0, None, None))
                continue
            n = e - s
            keys = self.arange[: c + n]
            mask = (keys.unsqueeze(0) <= (self.arange[:n] + c).unsqueeze(1)).view(1, 1, n, c + n)
            prefills.append(PrefillRow(s, e, c, stg.view(tb[0], tb[1]), mask))
        meta = AttentionMetadata(stg.view(slot_off, t), groups, prefills)
        return order, input_ids, stg.view(pos_off, t), meta, sample_rows, stg.view(li_off, len(logits_idx))

    # ---- the two-phase step ----

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        t0 = time.monotonic()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        order, input_ids, positions, meta, sample_rows, logits_idx = self._prepare_inputs(so)
        t1 = time.monotonic()
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        hidden = hidden.index_select(0, logits_idx)
        t2 = time.monotonic()
        args = {"num_reqs": len(order), "num_tokens": so.total_num_scheduled_tokens}
        events = [{"name": "prepare_inputs", "lane": "worker", "start": t0, "end": t1, "args": args},
                  {"name": "forward", "lane": "worker", "start": t1, "end": t2, "args": args}]
        self._step = _StepState(order, sample_rows, hidden, so.total_num_scheduled_tokens, t0, events)
        return None

    def _row_sampling(self, st: CachedRequestState) -> RowSampling:
        p = st.sampling_params
        stops: list[int] = []
        if p.min_tokens:
            stops = list(p.stop_token_ids)
            if self.eos_token_id is not None and not p.ignore_eos:
                stops.append(self.eos_token_id)
        num_out = len(st.token_ids) - st.num_prompt_tokens
        # The output history is copied only for rows whose penalties read it.
        outputs = st.output_token_ids if p.uses_penalties else []
        return RowSampling(p, st.generator, st.prompt_token_ids, outputs, stops, num_out)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample_tokens called without a preceding execute_model that ran a forward")
        t0 = time.monotonic()
        logits = self.model.compute_logits(step.hidden).float()
        rows = [self._row_sampling(self.requests[step.req_ids[b]]) for b in step.sample_rows]
        if grammar_output is not None and grammar_output.grammar_bitmask is not None:
            row_of = {step.req_ids[b]: i for i, b in enumerate(step.sample_rows)}
            pairs = [(row_of[r], k) for k, r in enumerate(grammar_output.structured_output_request_ids) if r in row_of]
            if pairs:
                mask = np.asarray(grammar_output.grammar_bitmask)[[k for _, k in pairs]]
                apply_bitmask(logits, [i for i, _ in pairs], mask)
        tokens, lps = sample(logits, rows) if rows else (torch.empty(0, dtype=torch.long, device=self.device), {})
        self.prev_sampled_token_ids = tokens
        self.prev_req_id_to_row = {step.req_ids[b]: i for i, b in enumerate(step.sample_rows)}
        sampled = tokens.tolist()
        out_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs = {}
        for i, b in enumerate(step.sample_rows):
            rid = step.req_ids[b]
            self.requests[rid].token_ids.append(sampled[i])
            out_ids[b] = [sampled[i]]
            if i in lps:
                logprobs[rid] = [lps[i]]
        t1 = time.monotonic()
        out = ModelRunnerOutput(step.req_ids, out_ids, logprobs, busy_s=t1 - step.t_start)
        if self.config.trace:
            args = {"num_reqs": len(step.req_ids), "num_tokens": step.num_tokens}
            out.trace_events = step.events + [{"name": "sample", "lane": "worker", "start": t0, "end": t1,
                                               "args": args}]
        return out
