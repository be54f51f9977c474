"""Split-KV decode counts sized to whole waves of resident blocks, and the resident-block estimate."""

from __future__ import annotations

from stepahead.attention.kv_splits import KernelFootprint, kv_splits, resident_blocks_per_sm

CHOICES = (1, 2, 4, 8, 16)
H200_SMS = 132


def test_resident_blocks_by_registers_warps_and_shared_memory():
    # 128 registers x 128 threads = 16384 of an SM's 65536: four blocks; one register more: three.
    assert resident_blocks_per_sm(KernelFootprint(128, 39936, 4)) == 4
    assert resident_blocks_per_sm(KernelFootprint(129, 39936, 4)) == 3
    assert resident_blocks_per_sm(KernelFootprint(168, 39936, 4)) == 3
    assert resident_blocks_per_sm(KernelFootprint(32, 0, 1)) == 32  # the per-SM block limit
    assert resident_blocks_per_sm(KernelFootprint(32, 0, 4)) == 16  # 64 warps an SM
    assert resident_blocks_per_sm(KernelFootprint(64, 96 * 1024, 8)) == 2  # shared memory binds
    assert resident_blocks_per_sm(KernelFootprint(255, 200 * 1024, 8)) == 1  # never fewer than one


def test_splits_fill_whole_waves():
    wave = H200_SMS * 3  # 396 programs at once
    # Batch 64 x 8 KV heads = 512 programs: 1.3 waves unsplit; two shares make 1024 = 2.6 waves of
    # half the work, which ends sooner (the old rule, 2 x SMs // programs, gave no split here).
    assert kv_splits(512, H200_SMS, 3, CHOICES) == 2
    # Batch 256: 2048 programs, 5.2 waves; splitting only adds programs.
    assert kv_splits(2048, H200_SMS, 3, CHOICES) == 1
    # Few rows: as many shares as fit in one wave, up to the most offered.
    assert kv_splits(8, H200_SMS, 3, CHOICES) == 16
    assert kv_splits(64, H200_SMS, 3, CHOICES) == 4  # 256 of 396; eight shares would be 1.3 waves
    assert kv_splits(wave, H200_SMS, 3, CHOICES) == 1  # exactly one full wave
    assert kv_splits(1, H200_SMS, 3, (1,)) == 1


def test_more_resident_blocks_can_make_a_split_unnecessary():
    # Four blocks an SM (528 at once) hold batch 64's 512 programs in one wave: no split.
    assert kv_splits(512, H200_SMS, 4, CHOICES) == 1
    assert kv_splits(512, H200_SMS, 3, CHOICES) == 2
