"""What a step's sampling reads besides the logits: each row's settings from its request, and the
grammars' bitmasks over the positions they constrain (with drafts, one per position a row follows).
"""

from __future__ import annotations

import numpy as np
import torch

from stepahead.core.sched_output import GrammarOutput
from stepahead.worker.request_state import CachedRequestState
from stepahead.worker.sampler import apply_bitmask
from stepahead.worker.sampling_metadata import RowSampling
from stepahead.worker.spec_decode.spec_decoder import first_positions
from stepahead.worker.step_output import StepState


def row_sampling(state: CachedRequestState, eos_token_ids: list[int]) -> RowSampling:
    """A request's sampling row: its settings, and the history its penalties, min_tokens and bad words read."""
    params = state.sampling_params
    stop_ids: list[int] = []
    if params.min_tokens:
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += eos_token_ids
    num_outputs = len(state.token_ids) - state.num_prompt_tokens
    # The output history is copied only for rows whose penalties or bad words read it.
    outputs = state.output_token_ids if params.reads_output_history else []
    return RowSampling(params, state.prompt_token_ids, outputs, stop_ids, num_outputs)


def apply_grammar_bitmask(logits: torch.Tensor, step: StepState, grammar_output: GrammarOutput) -> dict[int, int]:
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
