"""The SDPA path's decode rows: a token's attention output is bitwise the same whatever else is in its
batch, because every row is padded to a width of its own (padded_blocks), never to its group's longest."""

from __future__ import annotations

import torch

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.sdpa import AttentionMetadata, DecodeGroup, decode_groups, paged_attention

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _decode_meta(context_lens: list[int], blocks: list[list[int]]) -> AttentionMetadata:
    """Metadata for decode rows (sorted by length) whose token sits at the end of its context."""
    needs = [-(-n // BLOCK) for n in context_lens]
    groups = []
    for start, end, width in decode_groups(needs, max_blocks=64):
        rows = end - start
        table = torch.zeros(rows, width, dtype=torch.long)
        for r in range(rows):
            table[r, : needs[start + r]] = torch.tensor(blocks[start + r])
        keys = torch.arange(width * BLOCK)
        lens = torch.tensor(context_lens[start:end])
        mask = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(1, rows, 1, width * BLOCK)
        groups.append(DecodeGroup(start, end, table, mask))
    slots = torch.tensor([blocks[i][(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for i, n in enumerate(context_lens)])
    return AttentionMetadata(slots, groups, [])


def test_a_decode_rows_attention_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    cache = PagedKVCache(1, 64, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    # Rows of 150, 160 and 190 tokens: 10, 10 and 12 blocks, all padded to 12 blocks.
    lens = [150, 160, 190]
    blocks = [list(range(1, 11)), list(range(11, 21)), list(range(21, 33))]
    q = torch.randn(3, HEADS, HEAD_DIM)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    together = paged_attention(q, k, v, cache.layer(0), _decode_meta(lens, blocks), HEAD_DIM ** -0.5)
    assert len(_decode_meta(lens, blocks).decode_groups) == 1
    for i in range(3):
        alone = paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache.layer(0),
                                _decode_meta(lens[i:i + 1], blocks[i:i + 1]), HEAD_DIM ** -0.5)
        assert torch.equal(alone[0], together[i])
    # and the padded rows attend to their own context only
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[0].view(KV_HEADS, 3, 1, HEAD_DIM),
        cache.k[0][:, 1:11].reshape(KV_HEADS, 1, -1, HEAD_DIM)[:, :, :150].expand(KV_HEADS, 3, 150, HEAD_DIM),
        cache.v[0][:, 1:11].reshape(KV_HEADS, 1, -1, HEAD_DIM)[:, :, :150].expand(KV_HEADS, 3, 150, HEAD_DIM),
        scale=HEAD_DIM ** -0.5)
    assert torch.allclose(together[0], ref.reshape(HEADS, HEAD_DIM), atol=1e-5)
