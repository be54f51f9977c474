"""The persistent host/device staging buffer for a step's integer inputs (one host-to-device copy a step)."""

from __future__ import annotations

import numpy as np
import torch


class StagingBuffer:
    """One flat int64 host buffer filled region by region each step and sent to the device in one copy.

    On CPU the device view *is* the host memory (no copy at all); on CUDA the host side is pinned and
    copied with a single non-blocking transfer.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.on_cpu = device.type == "cpu"
        self.host = torch.zeros(capacity, dtype=torch.int64, pin_memory=not self.on_cpu and torch.cuda.is_available())
        self.np = self.host.numpy()
        self.dev = self.host if self.on_cpu else torch.zeros(capacity, dtype=torch.int64, device=device)
        self.used = 0

    def reset(self) -> None:
        self.used = 0

    def alloc(self, n: int) -> tuple[np.ndarray, int]:
        """Reserve n slots; returns the host numpy view and its offset. The capacity is sized for the
        worst step the scheduler limits allow, so views handed out earlier in a step stay valid."""
        off = self.used
        if off + n > self.np.shape[0]:
            raise RuntimeError(f"step inputs need {off + n} staging slots, capacity {self.np.shape[0]}")
        self.used = off + n
        return self.np[off:off + n], off

    def upload(self) -> None:
        if not self.on_cpu:
            self.dev[: self.used].copy_(self.host[: self.used], non_blocking=True)

    def view(self, off: int, n: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self.dev[off:off + n]
        return t if shape is None else t.view(shape)
