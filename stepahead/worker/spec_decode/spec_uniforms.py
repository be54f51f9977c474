"""The uniforms of speculative decoding's random draws, one per (request, output index).

A seeded request's uniform is a function of its seed, the output index it is drawn for and what it is
for (`counter_uniforms` over the seed salted by purpose), so its tokens are the same in every run
whatever its batch; unseeded ones come from the global torch RNG. RESAMPLE uses the seed unsalted: the
very uniform plain sampling draws at that output index.
"""

from __future__ import annotations

import torch

from stepahead.sampling_params import SamplingParams
from stepahead.worker.sampler import counter_uniforms
from stepahead.worker.sampling_metadata import seed_as_int64

RESAMPLE = 0  # the token drawn at the first rejection, or the bonus token
ACCEPT = 0x5D1A_7E0C_3B29_4F61  # whether a draft is accepted
DRAFT = 0x2C6B_91F3_0E57_A8D4  # the draft model's own draw of a draft


def uniforms(params: list[SamplingParams], output_index: list[int], purpose: int,
             device: torch.device | str) -> torch.Tensor:
    """float32 uniforms in [0, 1), one per (params[i], output_index[i])."""
    seeded = [p.seed is not None for p in params]
    u = torch.rand(len(params), device=device)
    if any(seeded):
        seeds = torch.tensor([seed_as_int64(p.seed or 0) ^ purpose for p in params], dtype=torch.long, device=device)
        counters = torch.tensor(output_index, dtype=torch.long, device=device)
        u = torch.where(torch.tensor(seeded, device=device), counter_uniforms(seeds, counters), u)
    return u
