"""The output head on packed weights, with its best candidates' logits recomputed in full precision.

At batch 1 the head is the largest single read of a small model's step (the built-in model's is
[49152, 576]: 113 MB in fp32), and an int8 head reads a quarter of that. But the packed kernels
round their outputs to bf16, a step of 0.06 for a logit near 16, and greedy choices between near
ties then flip (the built-in model answered "What is the capital of France?" with "L'Étoile"
instead of "The capital of France is Paris" when its top two logits were 0.08 apart).

So the packed head only ranks the vocabulary: the RESCORED_LOGITS best of each row are recomputed
as fp32 dot products with the dense weight (the same quantized values, dequantized; for a tied
head, the embedding the model keeps anyway) and written over their approximations. Greedy picks and
the logits near the top are the dense head's; the tail, which only matters through the softmax
normaliser, keeps the kernels' precision. Every operation here works on each row on its own, so a
row's logits do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

# How many of each row's best candidates get exact logits: the packed approximation is off by
# about 0.1 at most, far less than the gap between a row's 1st and 16th logit.
RESCORED_LOGITS = 16
# Logits per chunk when best_indices looks for the best chunks first.
CHUNK = 128


def best_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] indices of each row's k largest logits, in no order (ties broken either way).

    A row's k largest lie in the k chunks of CHUNK logits whose maxima are largest (any other chunk's
    values are below k chunk maxima), so only those chunks are searched. At 32 rows of a 49,152-token
    vocabulary this takes a third of topk over the whole rows, which read every logit for each of
    the k."""
    rows, vocab = logits.shape
    chunks = vocab // CHUNK
    if vocab % CHUNK or chunks <= k:
        return logits.topk(k, dim=-1, sorted=False).indices
    best_chunks = logits.reshape(rows, chunks, CHUNK).amax(-1).topk(k, dim=-1, sorted=False).indices  # [T, k]
    candidates = (best_chunks.unsqueeze(-1) * CHUNK
                  + torch.arange(CHUNK, device=logits.device)).view(rows, k * CHUNK)
    best = logits.gather(1, candidates).topk(k, dim=-1, sorted=False).indices
    return candidates.gather(1, best)


class RescoredHead(nn.Module):
    """packed: the head as a packed linear (Int4Linear/Int8Linear); dense: its [vocab, hidden] weight."""

    def __init__(self, packed: nn.Module, dense: torch.Tensor, rescored: int = RESCORED_LOGITS) -> None:
        super().__init__()
        if tuple(dense.shape) != (packed.out_features, packed.in_features):
            raise ValueError(f"dense head weight {tuple(dense.shape)} does not match the packed "
                             f"{(packed.out_features, packed.in_features)}")
        self.packed = packed
        self._dense = [dense]  # a list: the tied embedding's weight is not registered twice
        self.rescored = min(rescored, packed.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab] in hidden's dtype."""
        logits = self.packed(hidden)
        top = best_indices(logits, self.rescored)  # [T, k]
        exact = (self._dense[0][top] * hidden.unsqueeze(-2)).sum(-1)  # [T, k]: per-row dot products
        return logits.scatter_(-1, top, exact)
