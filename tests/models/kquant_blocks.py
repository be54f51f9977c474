"""GGUF k-quant blocks (Q4_K, Q5_K, Q6_K) made here, for tests: the gguf package dequantizes these types
but has no quantizer for them. A plain round-to-nearest quantizer (written for the tests, far simpler
than llama.cpp's search for the best scales) and valid random blocks."""

from __future__ import annotations

import numpy as np

SUPER = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block [n, 8] into llama.cpp's 12 bytes (the inverse of
    gguf.quants.Q4_K.get_scale_min)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate((low, mid, high), axis=1)


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _nibbles(q: np.ndarray, span: int) -> np.ndarray:
    """Codes [n, 256] (low four bits) as runs of span bytes: input i low, input i + span high."""
    q = (q & 0x0F).reshape(q.shape[0], -1, 2, span)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], -1)


def quantize_kquant(dense: np.ndarray, type_name: str) -> np.ndarray:
    """A float32 [rows, cols] matrix (cols a multiple of 256) as raw GGUF blocks of type_name."""
    rows, cols = dense.shape
    x = dense.astype(np.float32).reshape(-1, SUPER)
    n = x.shape[0]
    if type_name == "Q6_K":
        subs = x.reshape(n, 16, 16)
        sub_scale = np.abs(subs).max(-1) / 31
        d = (sub_scale.max(-1) / 127).astype(np.float16).astype(np.float32)
        d_safe = np.where(d > 0, d, 1)
        sc = np.clip(np.rint(sub_scale / d_safe[:, None]), 1, 127).astype(np.int8)
        step = d[:, None] * sc
        q = np.clip(np.rint(subs / np.where(step > 0, step, 1)[..., None]) + 32, 0, 63).astype(np.uint8).reshape(n, SUPER)
        ql = _nibbles(q, 64)
        hi = (q >> 4).reshape(n, 2, 4, 32)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
        blocks = np.concatenate((ql, qh, sc.view(np.uint8), _halves(d).reshape(n, 2)), axis=1)
        return blocks.reshape(rows, -1)
    levels = 15 if type_name == "Q4_K" else 31
    subs = x.reshape(n, 8, 32)
    lo = np.minimum(subs.min(-1), 0)
    sub_scale, sub_min = (subs.max(-1) - lo) / levels, -lo
    d = (sub_scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (sub_min.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(sub_scale / np.where(d > 0, d, 1)[:, None]), 0, 63)
    mn = np.clip(np.rint(sub_min / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    step = d[:, None] * sc
    q = np.rint((subs + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(n, SUPER)
    parts = [_halves(d).reshape(n, 2), _halves(dmin).reshape(n, 2), _pack_scales_mins(sc, mn)]
    if type_name == "Q5_K":
        hi = (q >> 4).reshape(n, 8, 32)
        parts.append(sum((hi[:, b] << b) for b in range(8)).astype(np.uint8))
    parts.append(_nibbles(q, 32))
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def random_kquant_blocks(rows: int, cols: int, type_name: str, seed: int = 0) -> np.ndarray:
    """Valid random blocks: every code, scale and min byte random, d (and dmin) small float16 values."""
    rng = np.random.default_rng(seed)
    n = rows * cols // SUPER
    blocks = rng.integers(0, 256, (n, BLOCK_BYTES[type_name]), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if type_name == "Q6_K":
        blocks[:, 208:210] = d
    else:
        blocks[:, 0:2] = d
        blocks[:, 2:4] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)
