"""The CPU path's attention: a token's output is bitwise the same whatever else is in its batch, for
decode rows with SDPA (every row padded to a width of its own, padded_blocks, never to its group's
longest) and with stepahead's decode kernel (each row read through its own block table), and for
prompt rows (same-length prompts side by side share one SDPA call); the kernel agrees with SDPA over
the same keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepahead.attention.paged_cache import PagedKVCache
from stepahead.attention.rows import BatchRow
from stepahead.kernels import cpu_build
from tests.attention.staged import attend_staged

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64

needs_kernels = pytest.mark.skipif(not cpu_build.machine_can_build(), reason="needs an AVX2 CPU and a C++ compiler")
PATHS = [pytest.param(False, id="sdpa"), pytest.param(True, id="kernel", marks=needs_kernels)]


def _attend(q, k, v, cache, rows: list[BatchRow], decode_kernel: bool, block_size: int) -> torch.Tensor:
    return attend_staged(q, k, v, cache, rows, decode_kernel, block_size, HEAD_DIM ** -0.5)


def _decode_rows(context_lens: list[int], blocks: list[list[int]]) -> list[BatchRow]:
    """Decode rows whose new token is the last of its context."""
    return [BatchRow(i, 1, n - 1, b) for i, (n, b) in enumerate(zip(context_lens, blocks, strict=True))]


def _cache(num_blocks: int, block_size: int, kv_heads: int = KV_HEADS) -> PagedKVCache:
    cache = PagedKVCache(1, num_blocks, block_size, kv_heads, HEAD_DIM, torch.float32, "cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    return cache


@pytest.mark.parametrize("decode_kernel", PATHS)
def test_a_decode_rows_attention_does_not_depend_on_its_batch(decode_kernel):
    torch.manual_seed(0)
    block = 16
    cache = _cache(64, block)
    # Rows of 150, 160 and 190 tokens: 10, 10 and 12 blocks (SDPA pads all of them to 12).
    lens = [150, 160, 190]
    blocks = [list(range(1, 11)), list(range(11, 21)), list(range(21, 33))]
    q = torch.randn(3, HEADS, HEAD_DIM)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    together = _attend(q, k, v, cache, _decode_rows(lens, blocks), decode_kernel, block)
    for i in range(3):
        alone = _attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, _decode_rows(lens[i:i + 1], blocks[i:i + 1]),
                        decode_kernel, block)
        assert torch.equal(alone[0], together[i])
    # and the padded rows attend to their own context only
    ref = F.scaled_dot_product_attention(
        q[0].view(KV_HEADS, 3, 1, HEAD_DIM),
        cache.k[0][:, 1:11].reshape(KV_HEADS, 1, -1, HEAD_DIM)[:, :, :150].expand(KV_HEADS, 3, 150, HEAD_DIM),
        cache.v[0][:, 1:11].reshape(KV_HEADS, 1, -1, HEAD_DIM)[:, :, :150].expand(KV_HEADS, 3, 150, HEAD_DIM),
        scale=HEAD_DIM ** -0.5)
    assert torch.allclose(together[0], ref.reshape(HEADS, HEAD_DIM), atol=1e-5)


@pytest.mark.parametrize("decode_kernel", PATHS)
def test_a_prompts_attention_does_not_depend_on_the_prompts_beside_it(decode_kernel):
    """Three 24-token prompts side by side (one causal SDPA call), one of 10 tokens, one of 24 after 16
    cached tokens, behind a decode row: each prompt's outputs are bitwise those it gets alone."""
    torch.manual_seed(1)
    block = 16
    cache = _cache(64, block)
    # (new tokens, cached tokens, blocks)
    prompts = [(24, 0, [1, 2]), (24, 0, [3, 4]), (24, 0, [5, 6]), (10, 0, [7]), (24, 16, [8, 9, 10])]
    rows, start = [BatchRow(0, 1, 40, [11, 12, 13])], 1
    for n, cached, blocks in prompts:
        rows.append(BatchRow(start, n, cached, blocks))
        start += n
    q = torch.randn(start, HEADS, HEAD_DIM)
    k, v = torch.randn(start, KV_HEADS, HEAD_DIM), torch.randn(start, KV_HEADS, HEAD_DIM)
    together = _attend(q, k, v, cache, rows, decode_kernel, block)
    for row, (n, cached, blocks) in zip(rows[1:], prompts, strict=True):
        span = slice(row.start, row.start + n)
        alone = _attend(q[span], k[span], v[span], cache, [BatchRow(0, n, cached, blocks)], decode_kernel, block)
        assert torch.equal(alone, together[span])
    # and a prompt of the shared call attends causally to its own tokens only
    qp, kp, vp = (x[25:49].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=HEAD_DIM ** -0.5, enable_gqa=True)
    assert torch.allclose(together[25:49], ref[0].transpose(0, 1), atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("kv_heads", [1, 3, 9])
def test_the_decode_kernel_agrees_with_sdpa_in_a_mixed_batch(block_size, kv_heads):
    """Ragged decode rows on scattered blocks, then a prefill with a cached prefix and a fresh prefill:
    the kernel's rows, decode and prompt tokens alike, equal SDPA's up to float rounding."""
    torch.manual_seed(block_size * 10 + kv_heads)
    cache_len = [1, 7, 33, 100]
    num_blocks = 4 + sum(-(-(n + 1) // block_size) for n in cache_len) + -(-40 // block_size)
    order = torch.randperm(num_blocks - 1).add(1).tolist()  # any block but the null block 0, shuffled
    rows, start = [], 0
    for n in cache_len:
        need = -(-n // block_size)
        rows.append(BatchRow(start, 1, n - 1, order[:need]))
        order, start = order[need:], start + 1
    prefix_blocks = -(-40 // block_size)
    rows.append(BatchRow(start, 8, 32, order[:prefix_blocks]))  # 8 new tokens after 32 cached
    rows.append(BatchRow(start + 8, 5, 0, order[prefix_blocks:prefix_blocks + -(-5 // block_size)]))
    tokens = start + 13
    sdpa_cache = _cache(num_blocks, block_size, kv_heads)
    kernel_cache = PagedKVCache(1, num_blocks, block_size, kv_heads, HEAD_DIM, torch.float32, "cpu")
    kernel_cache.k[0].copy_(sdpa_cache.k[0])
    kernel_cache.v[0].copy_(sdpa_cache.v[0])
    # q as the model hands it over: a view into a fused projection, rows strided past k and v
    qkv = torch.randn(tokens, HEADS + 2 * kv_heads, HEAD_DIM)
    q, k, v = qkv.split([HEADS, kv_heads, kv_heads], dim=1)
    by_sdpa = _attend(q, k, v, sdpa_cache, rows, False, block_size)
    by_kernel = _attend(q, k, v, kernel_cache, rows, True, block_size)
    assert torch.equal(kernel_cache.k[0], sdpa_cache.k[0]) and torch.equal(kernel_cache.v[0], sdpa_cache.v[0])
    torch.testing.assert_close(by_kernel, by_sdpa, atol=2e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_on_the_kernel_a_prompts_attention_does_not_depend_on_its_chunks(cache_dtype):
    """On the decode kernel a prompt token attends like a decode row at its position: a 40-token prompt
    in one step, in chunks of 13, 20 and 7 (each beside another request's decode row), and one token a
    step give bitwise the same outputs (chunked equals unchunked, cached equals uncached)."""
    torch.manual_seed(4)
    block, n = 16, 40
    blocks, other = [3, 1, 5], [2]  # the prompt's scattered blocks; a decode row's
    q = torch.randn(n, HEADS, HEAD_DIM)
    k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
    qd, kd, vd = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)

    def cache():
        c = PagedKVCache(1, 8, block, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
        c.k[0][:, other[0]].normal_()
        c.v[0][:, other[0]].normal_()
        return c

    whole = _attend(q, k.clone(), v.clone(), cache(), [BatchRow(0, n, 0, blocks)], True, block)
    chunked, parts, start = cache(), [], 0
    for size in (13, 20, 7):
        span = slice(start, start + size)
        rows = [BatchRow(0, 1, 9, other), BatchRow(1, size, start, blocks)]  # the decode row first, as the runner lays out
        out = _attend(torch.cat([qd, q[span]]), torch.cat([kd, k[span]]), torch.cat([vd, v[span]]), chunked, rows,
                      True, block)
        parts.append(out[1:])
        start += size
    assert torch.equal(torch.cat(parts), whole)
    stepwise = cache()
    one_at_a_time = [_attend(q[t:t + 1], k[t:t + 1].clone(), v[t:t + 1].clone(), stepwise, [BatchRow(0, 1, t, blocks)],
                             True, block) for t in range(n)]
    assert torch.equal(torch.cat(one_at_a_time), whole)


@needs_kernels
def _check_kernel_against_float64(heads: int, kv_heads: int, head_dim: int, block_size: int,
                                  cache_dtype: torch.dtype) -> None:
    """The kernel over rows of 1 to 77 keys in scattered blocks, against softmax(q k^T) v in float64
    over the cache's values (16-bit ones widen exactly, so only the float32 arithmetic differs)."""
    from stepahead.kernels import cpu_ops

    torch.manual_seed(head_dim + block_size + heads)
    lens = [1, 7, 8, 9, 40, 77]
    width = max(-(-n // block_size) for n in lens)
    k_cache, v_cache = torch.randn(2, kv_heads, len(lens) * width + 1, block_size, head_dim).to(cache_dtype).unbind(0)
    table = (torch.randperm(len(lens) * width) + 1).view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim)
    out = torch.empty_like(q)
    cpu_ops.paged_decode_attention(q, k_cache.contiguous(), v_cache.contiguous(), table, torch.tensor(lens),
                                   head_dim ** -0.5, out)
    for r, n in enumerate(lens):
        keys = k_cache[:, table[r]].reshape(kv_heads, -1, head_dim)[:, :n].double()
        values = v_cache[:, table[r]].reshape(kv_heads, -1, head_dim)[:, :n].double()
        qr = q[r].double().view(kv_heads, heads // kv_heads, head_dim)
        weights = torch.softmax(qr @ keys.transpose(1, 2) * head_dim ** -0.5, dim=-1)
        torch.testing.assert_close(out[r].double(), (weights @ values).reshape(heads, head_dim), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(16, 16), (80, 16), (128, 32), (64, 5), (12, 8)])
def test_the_decode_kernel_over_head_sizes_and_block_sizes(head_dim, block_size, cache_dtype):
    """Eight-token scores and 32 outputs at a time held in registers (head sizes a multiple of 8,
    blocks of a multiple of 8 tokens), the rest of a head past its multiple of 32, and the
    one-key-at-a-time path (blocks of 5 tokens, heads of 12)."""
    _check_kernel_against_float64(6, 2, head_dim, block_size, cache_dtype)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (10, 2), (16, 2)])
def test_the_decode_kernel_over_query_heads_per_kv_head(heads, kv_heads):
    """Query heads that share a KV head are computed three at a time (each key and value widened once
    for them): groups of 1, 2, 4 (3 + 1), 5 (3 + 2) and 8 heads."""
    _check_kernel_against_float64(heads, kv_heads, 64, 16, torch.float16)


@needs_kernels
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (16, 64), (32, 128), (16, 80), (5, 64)])
def test_the_decode_kernels_tiles_give_each_row_the_bits_it_gets_alone(cache_dtype, block_size, head_dim):
    """Rows that read the same keys (a prompt's tokens: one table, lengths counting up) are computed in
    tiles of up to eight; each row's output is bitwise the one it gets in a call of its own. Prompts of
    37 tokens after 20 cached and of 13 fresh ones, a decode row between them, then a row with the same
    lengths' table but one block different (it must not join the tile); heads of 80 floats and blocks
    of 5 tokens take the untiled path."""
    from stepahead.kernels import cpu_ops

    torch.manual_seed(block_size + head_dim)
    need = -(-57 // block_size)
    num_blocks = 3 * need + 2
    k_cache, v_cache = (torch.randn(KV_HEADS, num_blocks, block_size, head_dim).to(cache_dtype) for _ in range(2))
    blocks = torch.randperm(num_blocks - 1) + 1
    a, b = blocks[:need], blocks[need:2 * need]
    other = a.clone()
    other[0] = blocks[2 * need]  # the same table but for its first block
    table_rows = [a] * 37 + [b] + [b] * 13 + [other] * 2
    lens = list(range(21, 58)) + [40] + list(range(1, 14)) + [56, 57]
    table = torch.stack(table_rows)
    qkv = torch.randn(len(lens), HEADS + 2 * KV_HEADS, head_dim)
    q = qkv[:, :HEADS]  # strided rows, as the model hands them over
    together = torch.empty(len(lens), HEADS, head_dim)
    cpu_ops.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lens), head_dim ** -0.5, together)
    for r, n in enumerate(lens):
        alone = torch.empty(1, HEADS, head_dim)
        cpu_ops.paged_decode_attention(q[r:r + 1], k_cache, v_cache, table[r:r + 1], torch.tensor([n]),
                                       head_dim ** -0.5, alone)
        assert torch.equal(alone[0], together[r]), f"row {r}"
    # and the tiles attend to the right keys: against float64 over the cache's values
    for r in (0, 36, 38, 50, 52):
        keys = k_cache[:, table[r]].reshape(KV_HEADS, -1, head_dim)[:, :lens[r]].double()
        values = v_cache[:, table[r]].reshape(KV_HEADS, -1, head_dim)[:, :lens[r]].double()
        qr = q[r].double().reshape(KV_HEADS, HEADS // KV_HEADS, head_dim)
        weights = torch.softmax(qr @ keys.transpose(1, 2) * head_dim ** -0.5, dim=-1)
        torch.testing.assert_close(together[r].double(), (weights @ values).reshape(HEADS, head_dim),
                                   rtol=1e-5, atol=1e-5)


# how write_kv stores into a 16-bit cache: stepahead's one-pass kernel, or torch's operators
WRITERS = [pytest.param(True, id="kernel_write", marks=needs_kernels), pytest.param(False, id="torch_write")]


@pytest.fixture
def kernel_write(request, monkeypatch):
    if not request.param:
        monkeypatch.setattr("stepahead.attention.sdpa.cpu_build.available", lambda: False)
    return request.param


@pytest.mark.parametrize("kernel_write", WRITERS, indirect=True)
@pytest.mark.parametrize("decode_kernel", PATHS)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_holds_the_rounded_keys_every_row_attends_to(decode_kernel, cache_dtype, kernel_write):
    """Under a float32 model, a 16-bit cache stores the new K/V rounded as torch converts them, and a
    prompt attends to those rounded values even where it reads them from the step itself, not the cache:
    a prompt in one step equals the same prompt in two chunks (the second reading the first from the
    cache), and the decode rows equal the float32 path over the rounded values."""
    torch.manual_seed(3)
    block = 16
    cache = PagedKVCache(1, 8, block, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
    chunked = PagedKVCache(1, 8, block, KV_HEADS, HEAD_DIM, cache_dtype, "cpu")
    rounded = PagedKVCache(1, 8, block, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    q = torch.randn(20, HEADS, HEAD_DIM)
    k, v = torch.randn(20, KV_HEADS, HEAD_DIM) * 3, torch.randn(20, KV_HEADS, HEAD_DIM) * 3
    as_torch_rounds = k[:16].to(cache_dtype).transpose(0, 1).flatten(1)
    whole = _attend(q, k.clone(), v.clone(), cache, [BatchRow(0, 20, 0, [1, 2])], decode_kernel, block)
    assert torch.equal(cache.k[0][:, 1].flatten(1), as_torch_rounds)
    first = _attend(q[:13], k[:13], v[:13], chunked, [BatchRow(0, 13, 0, [1])], decode_kernel, block)
    second = _attend(q[13:], k[13:], v[13:], chunked, [BatchRow(0, 7, 13, [1, 2])], decode_kernel, block)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    # one decode row over the 20 cached keys and its own new one, against float32 over rounded values
    qd, kd, vd = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    got = _attend(qd, kd, vd, cache, [BatchRow(0, 1, 20, [1, 2])], decode_kernel, block)
    rounded.k[0].copy_(cache.k[0])
    rounded.v[0].copy_(cache.v[0])
    want = _attend(qd, kd.to(cache_dtype).float(), vd.to(cache_dtype).float(), rounded,
                   [BatchRow(0, 1, 20, [1, 2])], decode_kernel, block)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernel_write", WRITERS, indirect=True)
def test_a_value_beyond_float16_fails_the_step_loudly(kernel_write):
    cache = PagedKVCache(1, 4, 16, KV_HEADS, HEAD_DIM, torch.float16, "cpu")
    q, k, v = torch.randn(3, HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    k[1, 2, 5] = 70000.0  # float16's largest finite value is 65504
    with pytest.raises(RuntimeError, match="beyond float16's range"):
        _attend(q, k, v, cache, [BatchRow(0, 3, 0, [1])], False, 16)
    k[1, 2, 5] = 65000.0  # in range: rounds, does not fail
    _attend(q, k, v, cache, [BatchRow(0, 3, 0, [1])], False, 16)
