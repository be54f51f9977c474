"""vLLM's server load (GET /load, counted with --enable-server-load-tracking): the generation requests
the server is handling, from a request's arrival to its response's last byte (a stream's included), so
a router can send the next request to the least loaded replica."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

# The routes that put work on the engine.
TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


class ServerLoad:
    def __init__(self) -> None:
        self.num_requests = 0


class ServerLoadTracking:
    """ASGI middleware counting the requests in progress on TRACKED_PATHS into a ServerLoad."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACKED_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.num_requests += 1
        try:
            await self.app(scope, receive, send)  # returns once the whole response has been sent
        finally:
            self.load.num_requests -= 1
