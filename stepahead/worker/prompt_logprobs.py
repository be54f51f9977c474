"""Prompt logprobs, from the hidden states the step's forward pass computed anyway (no second forward).

The hidden state at position p gives the logits that predict the token at p + 1, so a step that
computes positions [start, end) of a prompt of P tokens yields the logprobs of the prompt tokens at
positions start + 1 .. min(end, P - 1). Chunks of one prompt therefore cover positions 1..P-1 between
them, each exactly once; a recompute after preemption covers them again with the same values (the
output processor keeps one entry per position). The logprobs are raw (a log-softmax of the logits,
before any sampling parameter), with -inf floored at LOGPROB_FLOOR, as for sampled tokens.

Every last-stage rank computes them (with tensor parallelism the logits' all-gather needs every rank);
only the sampling rank reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from stepahead.core.sched_output import PromptLogprobs, TokenLogprobs
from stepahead.outputs import LOGPROB_FLOOR
from stepahead.worker.request_state import CachedRequestState

# Prompt rows per logits matrix: bounds the [rows, vocab] float32 temporaries of a long prompt.
ROWS_PER_CHUNK = 256


@dataclass
class _RequestRun:
    """One request's prompt positions in this step, and the device tensors computed for them."""

    req_id: str
    start: int  # prompt position of the first entry
    targets: torch.Tensor  # [n] the prompt token at each position
    target_logprobs: torch.Tensor  # [n]
    ranks: torch.Tensor  # [n] 1-based rank of the prompt token
    top_logprobs: torch.Tensor | None  # [n, k]
    top_token_ids: torch.Tensor | None  # [n, k]


@dataclass
class StepPromptLogprobs:
    """The step's prompt logprobs on the device, converted to plain data when the output is built."""

    runs: list[_RequestRun]

    def to_host(self) -> dict[str, PromptLogprobs]:
        result = {}
        for run in self.runs:
            targets, values, ranks = run.targets.tolist(), run.target_logprobs.tolist(), run.ranks.tolist()
            top_v = run.top_logprobs.tolist() if run.top_logprobs is not None else None
            top_i = run.top_token_ids.tolist() if run.top_token_ids is not None else None
            entries = []
            for j, token_id in enumerate(targets):
                ids, lps = [token_id], [values[j]]
                if top_v is not None and top_i is not None:
                    ids += top_i[j]
                    lps += top_v[j]
                entries.append(TokenLogprobs(token_ids=ids, logprobs=lps, sampled_rank=ranks[j]))
            result[run.req_id] = PromptLogprobs(run.start, entries)
        return result


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    order: list[str],
    num_scheduled: Mapping[str, int],
    requests: Mapping[str, CachedRequestState],
) -> StepPromptLogprobs | None:
    """hidden: [num_tokens, hidden] of every scheduled token, rows in `order` with num_scheduled each;
    requests' num_computed_tokens are this step's ends (the runner counts a row's tokens as computed
    when it lays the step out). None when no row asks for prompt logprobs."""
    runs = []
    offset = 0
    for req_id in order:
        num_new = num_scheduled[req_id]
        state = requests[req_id]
        k = state.sampling_params.prompt_logprobs
        start = state.num_computed_tokens - num_new
        # Positions start .. last-1 predict prompt tokens start+1 .. last.
        last = min(start + num_new, state.num_prompt_tokens - 1)
        if k is not None and last > start:
            rows = hidden[offset:offset + last - start]
            targets = torch.tensor(state.prompt_token_ids[start + 1:last + 1], dtype=torch.long, device=hidden.device)
            runs.append(_run(compute_logits, req_id, start + 1, rows, targets, k))
        offset += num_new
    return StepPromptLogprobs(runs) if runs else None


def _run(compute_logits: Callable[[torch.Tensor], torch.Tensor], req_id: str, start: int, rows: torch.Tensor,
         targets: torch.Tensor, k: int) -> _RequestRun:
    chosen, ranks, top_v, top_i = [], [], [], []
    for i in range(0, rows.shape[0], ROWS_PER_CHUNK):
        logits = compute_logits(rows[i:i + ROWS_PER_CHUNK]).float()
        lp = logits.log_softmax(dim=1).nan_to_num_(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
        target_lp = lp.gather(1, targets[i:i + ROWS_PER_CHUNK].unsqueeze(1))
        chosen.append(target_lp.squeeze(1))
        ranks.append((lp > target_lp).sum(dim=1) + 1)
        if k != 0:  # -1: the whole vocabulary
            values, ids = lp.topk(lp.shape[1] if k == -1 else min(k, lp.shape[1]), dim=1)
            top_v.append(values)
            top_i.append(ids)
    return _RequestRun(req_id, start, targets, torch.cat(chosen), torch.cat(ranks),
                       torch.cat(top_v) if top_v else None, torch.cat(top_i) if top_i else None)
