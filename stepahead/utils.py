"""Small helpers shared by the torch-free core and the worker."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: how many blocks of b hold a items."""
    return -(-a // b)
