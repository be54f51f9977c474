"""The one shape of a bad-input message: "<field> <rule>, got <value>" (the API maps it to its param)."""

from __future__ import annotations


def check_field(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
