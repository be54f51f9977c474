"""The Triton kernels behind attention/triton_paged.py, which plans and launches them: its docstring
describes the cache and batch layout, the program tiles and the grids these kernels assume."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_key_tile(acc, m_i, l_i, start, q, q_pos, kv_begin, kv_end, qk_scale, window, softcap,
                     block_table_row, k_head, v_head,
                     stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                     BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                     SOFTCAP: tl.constexpr):
    """One online-softmax step over key positions start + offs_n (those in [kv_begin, kv_end) and <= each
    query's; under a WINDOW also > each query's - window). Keys outside [kv_begin, kv_end) are never
    loaded: with a window, their blocks may belong to another request by now."""
    pos = start + offs_n
    pos_ok = pos < kv_end
    if WINDOW:
        pos_ok = pos_ok & (pos >= kv_begin)
    # int64: block * stride overflows int32 on large caches. K and V share their strides, so the one
    # 64-bit offset per key serves both (two cost ~30 registers a thread).
    block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    key_offset = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    k = tl.load(k_head + key_offset[None, :] + offs_d[:, None] * stride_cd,
                mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=DOT_PRECISION)
    if SOFTCAP:
        # softcap * tanh(s * scale / softcap), tanh(x) = 1 - 2 / (e^2x + 1) (e^2x overflowing to inf gives 1);
        # qk_scale here is the plain softmax scale, the log2(e) of exp2 applied after the cap.
        x = s * (qk_scale / softcap)
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    else:
        s = s * qk_scale
    visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    if WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key yet keeps max -inf; subtract 0 there so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    v = tl.load(v_head + key_offset[:, None] + offs_d[None, :] * stride_cd,
                mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


# num_rows, row_start, slot_start and the block table's width change every step: specialising on them
# (Triton specialises ints equal to 1 or divisible by 16) would compile new variants while serving.
@triton.jit(do_not_specialize=["num_rows", "row_start", "slot_start", "stride_bt", "window"])
def paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    split_acc_ptr, split_max_ptr, split_sum_ptr,  # split-KV scratch; unused when NUM_SPLITS == 1
    qk_scale,  # softmax scale * log2(e): the kernel exponentiates with exp2 (SOFTCAP: the plain scale)
    window,  # WINDOW: a query at position p attends to keys p - window + 1 .. p
    softcap,  # SOFTCAP: scores become softcap * tanh(score / softcap)
    num_rows,
    row_start, slot_start,  # general launch: its first row and that row's first tile slot (0, 0: all rows)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_ch, stride_cb, stride_cs, stride_cd,  # of k_cache and v_cache alike
    stride_bt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DECODE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    kv_head = tl.program_id(1)
    if DECODE:
        row = tl.program_id(0)
        q_tile = 0
    else:
        # Largest row whose first tile slot is <= this program's slot.
        slot = tl.program_id(0) + slot_start
        lo = tl.full([], 0, tl.int32) + row_start
        hi = tl.full([], 0, tl.int32) + num_rows - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= slot:
                lo = mid
            else:
                hi = mid - 1
        row = lo
        q_tile = slot - (tl.load(query_start_loc_ptr + row).to(tl.int32) // BLOCK_Q + row)

    # Per-row metadata as int32 whatever its dtype (the staging buffer is int64): token indices,
    # positions and lengths fit, and 64-bit index math costs ~40 registers a thread (one resident block
    # less per SM). Only the products that address the cache (block * stride) are widened to int64.
    q_start = tl.load(query_start_loc_ptr + row).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + row + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_local = q_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = q_start + q_local
    q_pos = context_len + q_local

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys past the tile's last query position are masked for every row of the tile: stop there.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    block_table_row = block_table_ptr + row.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_ch
    kv_start = 0
    if WINDOW:
        # The tile's first query sees keys from its position - window + 1 on; the later ones from later.
        kv_start = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0)
    kv_begin = kv_start
    if NUM_SPLITS > 1:
        # This program's share of the keys: equal shares rounded up to whole key steps (some may be empty).
        split = tl.program_id(2)
        share = tl.cdiv(tl.cdiv(kv_end - kv_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_begin + split * share
        kv_end = tl.minimum(kv_end, kv_start + share)
    if INTERPRETED:
        # Triton's interpreter cannot use a device value as a range() bound under NumPy >= 2.4; compiled
        # code keeps the for loop, which Triton software-pipelines (num_stages) and a while loop it does not.
        start = kv_start
        while start < kv_end:
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, start, q, q_pos, kv_begin, kv_end, qk_scale, window, softcap,
                block_table_row, k_head, v_head, stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                BLOCK_SIZE, DOT_PRECISION, WINDOW, SOFTCAP)
            start += BLOCK_N
    else:
        for start in range(kv_start, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, start, q, q_pos, kv_begin, kv_end, qk_scale, window, softcap,
                block_table_row, k_head, v_head, stride_cb, stride_cs, stride_cd, offs_n, offs_d, d_ok,
                BLOCK_SIZE, DOT_PRECISION, WINDOW, SOFTCAP)

    if NUM_SPLITS > 1:
        # Scratch is [num_rows, num_heads, NUM_SPLITS] (+ [HEAD_DIM] for acc); empty shares store max -inf,
        # sum 0 and acc 0, which the merge weighs as nothing.
        part = (row * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(split_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(split_max_ptr + part, m_i, mask=row_ok)
        tl.store(split_sum_ptr + part, l_i, mask=row_ok)
    else:
        # Rows that saw no key (seq_len 0 padding rows) store zeros.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_kv_splits_kernel(
    out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr, query_start_loc_ptr,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + row).to(tl.int32)
    if tl.load(query_start_loc_ptr + row + 1).to(tl.int32) == tok:  # no new token: the attention kernel wrote nothing
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    part = (row * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    share_max = tl.load(split_max_ptr + part, mask=s_ok, other=float("-inf"))
    share_sum = tl.load(split_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(split_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(share_max, 0)
    # Rescale every share to the overall max (exp2: maxima are in log2 units); max -inf means no key at all.
    weight = tl.math.exp2(share_max - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(weight * share_sum, 0)
    o = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kch, stride_kcb, stride_kcs, stride_kcd,
    stride_vch, stride_vcb, stride_vcs, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // block_size
    in_block = slot % block_size
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # head * stride overflows int32 on large caches
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + h * stride_kch + block * stride_kcb + in_block * stride_kcs + d * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + h * stride_vch + block * stride_vcb + in_block * stride_vcs + d * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
