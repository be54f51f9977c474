"""What bad input raises, and the one shape of its message: "<field> <rule>, got <value>"."""

from __future__ import annotations

from stepahead.errors import StepaheadError


class InvalidInputError(StepaheadError, ValueError):
    """Input stepahead refuses: a prompt, a sampling parameter, an engine setting, or a feature not built yet.

    A ValueError too, for callers that caught that before the type existed. `param` names the field
    at fault when there is one; the API server reports it as the error's param.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# A message quotes at most this much of the value it refuses: the input can be megabytes.
MAX_QUOTED_CHARS = 200


def shorten(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """text, or its first `limit` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def check_field(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidInputError(f"{name} {rule}, got {shorten(repr(value))}", param=name)
