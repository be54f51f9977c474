"""Lazy weight handles: a checkpoint tensor read only in the part a rank keeps.

Loaders yield (name, WeightHandle); the model asks each handle for its rank's slice (narrow), so a
rank of a tensor- or pipeline-parallel model reads its shard of a safetensors file (safe_open's
get_slice) and skips the layers of other stages without reading them at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class WeightHandle:
    """A checkpoint tensor by shape; read whole (load) or one slice along one dimension (narrow)."""

    def __init__(self, shape: tuple[int, ...], read_slice: Callable[[int, int, int], torch.Tensor]) -> None:
        self.shape = tuple(shape)
        self._read_slice = read_slice  # (dim, start, length) -> tensor

    def load(self) -> torch.Tensor:
        return self._read_slice(0, 0, self.shape[0]) if self.shape else self._read_slice(0, 0, 0)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._read_slice(dim, start, length)


def tensor_handle(t: torch.Tensor) -> WeightHandle:
    """A handle over a tensor already in memory (GGUF without the model cache, tests)."""
    if t.dim() == 0:
        return WeightHandle((), lambda dim, start, length: t)
    return WeightHandle(tuple(t.shape), lambda dim, start, length: t.narrow(dim, start, length))


def safetensors_handle(st, name: str) -> WeightHandle:
    """A handle over one tensor of an open safetensors file (safe_open): reads only the slice asked for."""
    sl = st.get_slice(name)
    shape = tuple(sl.get_shape())
    if not shape:
        return WeightHandle((), lambda dim, start, length: st.get_tensor(name))

    def read(dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple(slice(None) if d != dim else slice(start, start + length) for d in range(len(shape)))
        return sl[index]

    return WeightHandle(shape, read)


def as_handle(w) -> WeightHandle:
    return w if isinstance(w, WeightHandle) else tensor_handle(w)
