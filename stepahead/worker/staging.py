"""The persistent host/device staging buffer for a step's integer inputs (one host-to-device copy a step)."""

from __future__ import annotations

import numpy as np
import torch

ALIGNMENT_SLACK = 64  # each region starts 16-byte aligned: at most one slot lost per region


def step_capacity(max_tokens: int, max_rows: int, max_blocks_per_seq: int) -> int:
    """The slots of the worst step of max_tokens tokens in max_rows attention rows: 6 per token (ids,
    positions, slots, prompt/generated row index, the decode kernel's keys per token and token-to-request
    index), the block tables of every row, 6 per row."""
    return 6 * max_tokens + 6 * max_rows + 1 + 2 * max_rows * max_blocks_per_seq + ALIGNMENT_SLACK


class StagingBuffer:
    """One flat int64 host buffer filled region by region each step and sent to the device in one copy.

    On CPU the device view *is* the host memory (no copy at all). On CUDA the host side is pinned and
    copied with a single non-blocking transfer. The host does not wait for the GPU between steps, so
    step N's copy may still be queued when step N+1 is laid out: two pinned host buffers take turns,
    and a buffer is refilled only once the event recorded after its last copy has passed (normally
    long before, so the wait costs nothing). The device buffer needs no second copy: copies and the
    kernels that read them run in order on one stream.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        num_host = 1 if self.on_cpu else 2
        pin = not self.on_cpu and torch.cuda.is_available()
        self._hosts = [torch.zeros(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(num_host)]
        # blocking: a wait sleeps instead of spinning a core
        self._copied = [] if self.on_cpu else [torch.cuda.Event(blocking=True) for _ in range(num_host)]
        self._turn = 0
        self.host = self._hosts[0]
        self.np = self.host.numpy()
        self.dev = self.host if self.on_cpu else torch.zeros(capacity, dtype=torch.int64, device=device)
        self.used = 0

    def reset(self) -> None:
        """Start a step's layout in the host buffer whose last copy has finished."""
        self.used = 0
        if self.on_cpu:
            return
        self._turn = 1 - self._turn
        self._copied[self._turn].synchronize()  # returns at once for an event never recorded
        self.host = self._hosts[self._turn]
        self.np = self.host.numpy()

    def alloc(self, n: int) -> tuple[np.ndarray, int]:
        """Reserve n slots; returns the host numpy view and its offset. The capacity is sized for the
        worst step the scheduler limits allow, so views handed out earlier in a step stay valid."""
        off = (self.used + 1) & ~1  # 16-byte aligned: Triton compiles one variant for aligned pointers
        if off + n > self.np.shape[0]:
            raise RuntimeError(f"step inputs need {off + n} staging slots, capacity {self.np.shape[0]}")
        self.used = off + n
        return self.np[off:off + n], off

    def upload(self) -> None:
        if not self.on_cpu:
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)
            self._copied[self._turn].record()

    def view(self, off: int, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.dev[off:off + n]
        return t if shape is None else t.view(shape)
