"""Sampling that fails a request, not the step.

The batch is sampled in one vectorized call. If that call raises, the fault is one row's (its
parameters, its logits) or everyone's; to tell which, each row is sampled alone. Rows that sample
fine get their tokens (greedy and seeded rows the same ids the batch would have given them: `sample`
leaves the logits as a second call needs them); rows that still raise are reported with the reason,
and the scheduler fails those requests alone. If every row fails, the fault is the step's and the
first error is raised as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from stepahead.core.sched_output import TokenLogprobs
from stepahead.worker.sampler import SamplerOutput, logprobs_to_host, sample
from stepahead.worker.sampling_metadata import RowSampling, SamplingMetadata

logger = logging.getLogger(__name__)


@dataclass
class RowsApart:
    """The result of sampling a step's rows one at a time."""

    token_ids: list[int]  # one per row; a failed row's entry is 0, never delivered
    logprobs: dict[int, TokenLogprobs]  # by row, for the rows that asked
    failed: dict[int, str]  # row -> why its sampling failed


def sample_batch(logits: torch.Tensor, rows: list[RowSampling],
                 device: torch.device) -> tuple[SamplingMetadata | None, SamplerOutput, RowsApart | None]:
    """The step's rows sampled in one call: (its metadata, the sampled ids and logprobs, None), or when
    that call raises, each row sampled alone: (None, the rows' ids, RowsApart)."""
    try:
        metadata = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device) if rows else None
        if metadata is not None:
            return metadata, sample(logits, metadata), None
        return None, SamplerOutput(torch.empty(0, dtype=torch.long, device=device)), None
    except Exception as e:  # a row's failure fails its request, not the step
        apart = sample_rows_apart(logits, rows, e)
        return None, SamplerOutput(torch.tensor(apart.token_ids, dtype=torch.long, device=device)), apart


def sample_rows_apart(logits: torch.Tensor, rows: list[RowSampling], batch_error: Exception) -> RowsApart:
    token_ids: list[int] = []
    logprobs: dict[int, TokenLogprobs] = {}
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            md = SamplingMetadata.from_rows([row], logits.shape[1], logits.device)
            out = sample(logits[i:i + 1], md)
            token = int(out.sampled_token_ids[0])
            if md.max_num_logprobs is not None:
                logprobs[i] = logprobs_to_host(out, md, [token])[0]
        except Exception as e:  # this row's fault: its request fails alone
            token = 0
            failed[i] = f"sampling failed: {e!r}"
        token_ids.append(token)
    if len(failed) == len(rows):
        raise batch_error
    logger.error("sampling failed for %d of %d rows (%s); those requests fail, the others go on",
                 len(failed), len(rows), batch_error)
    return RowsApart(token_ids, logprobs, failed)
