"""How many key shares a split-KV decode launch uses, sized to whole waves of resident blocks.

A decode launch has one program per (row, KV head) and, split s ways, s times as many, each over 1/s
of the row's keys. A GPU runs them in waves of (SMs x blocks resident per SM): a launch of 1.3 waves
takes as long as two full ones. So the split count is the one whose launch ends soonest, modelled as
waves x (1/s of a row's keys + a fixed cost per program: loading q, storing the share, the merge).
The count must not depend on context lengths: a captured CUDA graph fixes it per padded batch size.

Plain functions of plain numbers, so they are tested without a GPU; the resident-block estimate uses
the kernels' registers and shared memory on sm_90, which tests/attention/test_triton_aot.py checks
against the compiled kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# One SM of sm_80/sm_90 (H100/H200; A100 differs only in shared memory, 164 KB).
REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_BYTES_RESERVED_PER_BLOCK = 1024  # the runtime's own share of each block's shared memory
# A program's cost beyond its keys, as a fraction of one whole row's key work.
FIXED_COST_PER_PROGRAM = 0.125


@dataclass(frozen=True)
class KernelFootprint:
    """What one block of a kernel holds on an SM."""

    registers: int  # per thread
    shared_bytes: int
    num_warps: int


def resident_blocks_per_sm(footprint: KernelFootprint) -> int:
    """How many blocks of the kernel an SM holds at once: the tightest of registers, warps, shared memory."""
    unit = REGISTER_ALLOCATION_UNIT
    registers_per_warp = -(-footprint.registers * 32 // unit) * unit
    by_registers = REGISTERS_PER_SM // (registers_per_warp * footprint.num_warps)
    by_warps = MAX_WARPS_PER_SM // footprint.num_warps
    by_shared = SHARED_BYTES_PER_SM // (footprint.shared_bytes + SHARED_BYTES_RESERVED_PER_BLOCK)
    return max(1, min(by_registers, by_warps, by_shared, MAX_BLOCKS_PER_SM))


def kv_splits(num_programs: int, num_sms: int, blocks_per_sm: int, choices: tuple[int, ...]) -> int:
    """The split count from `choices` (ascending) whose launch of num_programs programs a split ends
    soonest on num_sms SMs holding blocks_per_sm blocks each; ties go to fewer splits."""
    wave = num_sms * blocks_per_sm
    best, best_time = choices[0], math.inf
    for splits in choices:
        waves = -(-num_programs * splits // wave)
        time = waves * (1 / splits + FIXED_COST_PER_PROGRAM)
        if time < best_time * (1 - 1e-9):
            best, best_time = splits, time
    return best
