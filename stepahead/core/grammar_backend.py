"""The scheduler's grammar hook: what it asks of the structured-output backend
(structured_output.StructuredOutputManager, a layer above it that it never imports)."""

from __future__ import annotations

from typing import Any, Protocol

from stepahead.request import Request


class StructuredOutputBackend(Protocol):
    """The grammar hook (structured_output.StructuredOutputManager). Without one the scheduler still
    defers grammar steps' sampling but constrains nothing; the input processor refuses structured
    requests when no backend is configured."""

    def submit(self, request: Request) -> None: ...  # start compiling; sets request.structured_output

    def is_ready(self, request: Request) -> bool: ...

    def compile_error(self, request: Request) -> str | None: ...

    def grammar_bitmask(self, requests: list[Request]) -> Any: ...

    def draft_bitmask(self, requests: list[Request], drafts: list[list[int]]) -> Any: ...

    def grammatical_prefix(self, request: Request, draft_token_ids: list[int]) -> int: ...

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool: ...

    def is_terminated(self, request: Request) -> bool: ...

    def wait_for_any(self, requests: list[Request], timeout: float) -> None: ...  # until one compile is done

    def shutdown(self) -> None: ...
