"""The OpenAI-compatible HTTP server: FastAPI app factory and the uvicorn runner behind `stepahead serve`.

Startup binds the socket first (clients connecting during the model load wait in the backlog
instead of being refused), then starts the engine process, then serves. SIGINT/SIGTERM stop
accepting; in-flight requests are aborted (--shutdown-timeout 0) or drained for up to that many
seconds; then the engine process and its worker are stopped. If the engine dies, /health turns 503,
in-flight requests get an error, and the server exits (status 1) a moment later.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from stepahead.config import ModelConfig
from stepahead.engine.async_llm import AsyncLLM
from stepahead.entrypoints.engine_flags import engine_args_from_namespace
from stepahead.entrypoints.openai.errors import (
    APIError,
    APIKeyMiddleware,
    document_errors,
    install_error_handlers,
)
from stepahead.entrypoints.openai.metrics import METRICS_PREFIXES, ServerMetrics, log_stats_periodically
from stepahead.entrypoints.openai.parser_tokens import parser_tokens
from stepahead.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from stepahead.entrypoints.openai.request_limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodySizeLimit,
    Offload,
    RequestLimits,
    default_max_sequences,
)
from stepahead.entrypoints.openai.responses_input import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from stepahead.entrypoints.openai.responses_protocol import ResponsesRequest
from stepahead.entrypoints.openai.server_args import make_parser
from stepahead.entrypoints.openai.server_load import ServerLoad, ServerLoadTracking
from stepahead.entrypoints.openai.serving_chat import OpenAIServingChat, message_chars, render_chat
from stepahead.entrypoints.openai.serving_completions import OpenAIServingCompletion
from stepahead.entrypoints.openai.serving_responses import OpenAIServingResponses
from stepahead.entrypoints.openai.serving_utils import ServedModel, encode_ids
from stepahead.entrypoints.openai.tokenizer_info import tokenizer_info
from stepahead.models.loading.loader import load_tokenizer

logger = logging.getLogger("stepahead.entrypoints.openai")

DEAD_ENGINE_EXIT_DELAY_S = 2.0  # lets in-flight error responses and a /health probe see the failure
# After the drain deadline has cut the requests still running, time for their 503s to go out.
DRAIN_GRACE_S = 2.0
API_KEY_ENV = "STEPAHEAD_API_KEY"
BaseModelT = TypeVar("BaseModelT", bound=BaseModel)


def stepahead_version() -> str:
    try:
        from importlib.metadata import version

        return version("stepahead")
    except Exception:  # running from a source tree without metadata
        return "0.0.0+unknown"


@dataclass
class ServerState:
    draining: bool = False


def build_app(engine: AsyncLLM, model: ServedModel, api_key: str | None = None,
              state: ServerState | None = None, limits: RequestLimits | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_parser: str | None = None,
              reasoning_parser: str | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              enable_prompt_tokens_details: bool = False, metrics_prefix: str = "stepahead",
              return_tokens_as_token_ids: bool = False, enable_tokenizer_info_endpoint: bool = False,
              enable_server_load_tracking: bool = False) -> FastAPI:
    """tool_parser: the --tool-call-parser for tool_choice "auto"; None refuses "auto". reasoning_parser:
    the --reasoning-parser; None leaves the output whole. max_stored_responses: /v1/responses kept for
    previous_response_id. enable_prompt_tokens_details: usage counts the prompt tokens the prefix cache
    held. metrics_prefix: "stepahead" or "vllm", the metric families' prefix. return_tokens_as_token_ids:
    the default of the request field. enable_tokenizer_info_endpoint: serve GET /tokenizer_info.
    enable_server_load_tracking: GET /load counts the generation requests in progress (else it stays 0)."""
    state = state or ServerState()
    limits = limits or RequestLimits(model.max_model_len,
                                     default_max_sequences(engine.config.scheduler_config.max_num_seqs))
    app = FastAPI(title="stepahead", version=stepahead_version())
    install_error_handlers(app)
    document_errors(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    load = ServerLoad()
    if enable_server_load_tracking:
        app.add_middleware(ServerLoadTracking, load=load)
    metrics = ServerMetrics(model.name, model.max_model_len, engine.get_stats, METRICS_PREFIXES[metrics_prefix],
                            engine.config.cache_config, engine.config.scheduler_config.max_num_batched_tokens)
    engine.stats_listeners.append(metrics.record)
    offload = Offload()
    completions = OpenAIServingCompletion(engine, model, limits, offload, enable_prompt_tokens_details,
                                          return_tokens_as_token_ids)
    chat = OpenAIServingChat(engine, model, limits, offload, enable_prompt_tokens_details, return_tokens_as_token_ids,
                             tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    responses = OpenAIServingResponses(chat, ResponseStore(max_stored_responses))
    app.state.engine, app.state.metrics, app.state.server_state = engine, metrics, state

    def accepting(request: Request) -> None:
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise RequestValidationError([{"loc": ("header", "content-type"), "type": "value_error",
                                           "msg": "Unsupported Media Type: Only 'application/json' is allowed"}])
        if state.draining:
            raise APIError("The server is shutting down", 503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.is_dead else 200, media_type="text/plain")

    @app.get("/load")
    async def server_load() -> dict:
        return {"server_load": load.num_requests}

    @app.get("/version")
    async def version() -> dict:
        return {"version": stepahead_version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=model.root, max_model_len=model.max_model_len) for name in model.names]
        return ModelList(data=cards).model_dump(mode="json")

    @app.post("/v1/completions", dependencies=[Depends(accepting)])
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(accepting)])
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/v1/responses", dependencies=[Depends(accepting)])
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @app.post("/invocations", dependencies=[Depends(accepting)])
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point, as vLLM serves it: the body's fields say which endpoint it is for."""
        body = await invocation_body(request)
        if "messages" in body:
            return await chat.create(parsed(ChatCompletionRequest, body), request)
        if "prompt" in body:
            return await completions.create(parsed(CompletionRequest, body), request)
        raise APIError("an invocation is a chat completion (with messages) or a completion (with prompt) request",
                       400, "messages")

    @app.post("/tokenize", dependencies=[Depends(accepting)])
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        model.check(body.model)
        tokenizer = engine.tokenizer
        if body.messages is not None:
            limits.check_chars(message_chars(body.messages), "messages")
            text = await offload.run(render_chat, tokenizer, body.messages, body.add_generation_prompt,
                                     body.continue_final_message, None, None, None, body.tools)
            add_special = bool(body.add_special_tokens)
        elif body.prompt is not None:
            limits.check_chars(len(body.prompt), "prompt")
            text = body.prompt
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
        else:
            raise APIError("Either prompt or messages is required", 400, "prompt")
        tokens = await offload.run(encode_ids, tokenizer, text, add_special)
        limits.check_tokens(len(tokens), "prompt" if body.messages is None else "messages")
        body_out: dict = {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens,
                          "token_strs": tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None}
        return JSONResponse(body_out)

    @app.post("/detokenize", dependencies=[Depends(accepting)])
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        model.check(body.model)
        vocab_size = engine.model_config.vocab_size
        out_of_vocab = [token_id for token_id in body.tokens if not 0 <= token_id < vocab_size]
        if out_of_vocab:
            raise APIError(f"tokens must be token ids in [0, {vocab_size}), got {out_of_vocab[:8]}", 400, "tokens")
        return JSONResponse({"prompt": await offload.run(engine.tokenizer.decode, body.tokens)})

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenizer_info(engine.tokenizer))

    return app


async def invocation_body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestValidationError([{"loc": ("body",), "type": "json_invalid", "msg": f"JSON decode error: {e}"}]) from None
    if not isinstance(body, dict):
        raise RequestValidationError([{"loc": ("body",), "type": "dict_type", "msg": "the body must be a JSON object"}])
    return body


def parsed(model: type[BaseModelT], body: dict) -> BaseModelT:
    """The body as the endpoint's request model; a bad field is the 400 a direct call would get."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def served_model(engine: AsyncLLM, requested_name: str | None, model_arg: str | None) -> ServedModel:
    model_config = engine.model_config
    # The folder's or file's base name by default (the full path stays in the log and in /v1/models' root).
    name = requested_name or model_config.served_model_name or Path(model_arg or model_config.model).name
    name = name.removesuffix(".gguf")
    return ServedModel(names=[name], root=model_config.model, max_model_len=model_config.max_model_len)


class _Server(uvicorn.Server):
    """uvicorn's server with our first reaction to SIGINT/SIGTERM: refuse new work, abort or drain."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self._engine, self._state, self._shutdown_timeout = engine, state, shutdown_timeout

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self._state.draining:
            self._state.draining = True
            # A signal handler may interrupt the event loop anywhere: do the work as a loop callback.
            self._loop.call_soon_threadsafe(self._begin_shutdown)
        super().handle_exit(sig, frame)
        # uvicorn would re-raise the signal after serving; we exit normally, after stopping the engine.
        self._captured_signals.clear()

    def _begin_shutdown(self) -> None:
        in_flight = self._engine.num_in_flight
        if self._shutdown_timeout > 0:
            logger.info("Shutting down: draining %d in-flight request(s) for up to %.0f s", in_flight,
                        self._shutdown_timeout)
            # At the deadline, what still runs is cut the same way: uvicorn's own deadline comes
            # DRAIN_GRACE_S later, time for each cut request to send its 503.
            self._loop.call_later(self._shutdown_timeout, self._abort_in_flight)
        else:
            self._abort_in_flight()

    def _abort_in_flight(self) -> None:
        # An APIError, not a RuntimeError: each cut request answers a clean 503 (an error event if
        # streamed) instead of a 500 with a traceback in the log.
        logger.info("Shutting down: aborting %d in-flight request(s)", self._engine.num_in_flight)
        self._engine.abort_all(APIError("The server is shutting down", 503))


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def resolve_api_key(ns: argparse.Namespace, env) -> str | None:
    """--api-key wins over $STEPAHEAD_API_KEY; an empty value means no key."""
    return ns.api_key or env.get(API_KEY_ENV) or None


def non_default_args(ns: argparse.Namespace, defaults: argparse.Namespace) -> dict:
    changed = {}
    for name, value in sorted(vars(ns).items()):
        if name in ("func", "command") or getattr(defaults, name, None) == value:
            continue
        changed[name] = "**REDACTED**" if name == "api_key" else value
    return changed


def tool_parser(ns: argparse.Namespace) -> str | None:
    """The tool-call parser the server reads "auto" calls with (none without --enable-auto-tool-choice)."""
    return ns.tool_call_parser if ns.enable_auto_tool_choice else None


def checked_tokenizer(model_config: ModelConfig, tool_parser: str | None, reasoning_parser: str | None) -> Any:
    """The model's tokenizer, once it can write the parsers' markers; raises ValueError naming the ones it
    cannot (parser_tokens.py). Loaded before the engine, so a refused configuration never loads the model."""
    tokenizer = load_tokenizer(model_config)
    parser_tokens(tokenizer, tool_parser, reasoning_parser)
    return tokenizer


async def run_server(ns: argparse.Namespace) -> int:
    api_key = resolve_api_key(ns, os.environ)
    sock = bind_socket(ns.host, ns.port)
    host, port = sock.getsockname()[:2]
    logger.info("stepahead %s: serving on http://%s:%d (the model loads next)", stepahead_version(), host, port)
    logger.info("Non-default args: %s", non_default_args(ns, make_parser().parse_args([])))
    try:
        if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        engine_args = engine_args_from_namespace(ns)
        if ns.trace_file:
            engine_args.trace = True
        config = engine_args.create_engine_config()
        logger.info("Model: %s (max_model_len %d, %d KV blocks of %d tokens, executor %s, async scheduling %s)",
                    config.model_config.model, config.model_config.max_model_len, config.cache_config.num_blocks,
                    config.cache_config.block_size, config.executor, config.async_scheduling)
        tokenizer = checked_tokenizer(config.model_config, tool_parser(ns), ns.reasoning_parser)
        engine = AsyncLLM(config, tokenizer, trace_path=ns.trace_file)
    except ValueError as e:
        logger.error("Invalid configuration: %s", e)
        sock.close()
        return 2
    try:
        await engine.start()
    except Exception as e:  # startup failure: a clear line and a non-zero exit
        logger.error("%s", e)
        engine.shutdown()
        sock.close()
        return 1
    state = ServerState()
    model = served_model(engine, ns.served_model_name, engine_args.model)
    limits = RequestLimits(model.max_model_len,
                           ns.max_sequences_per_request or default_max_sequences(config.scheduler_config.max_num_seqs),
                           ns.trust_request_chat_template)
    app = build_app(engine, model, api_key, state, limits, ns.max_request_bytes, tool_parser(ns), ns.reasoning_parser,
                    ns.max_stored_responses, ns.enable_prompt_tokens_details, ns.metrics_prefix,
                    ns.return_tokens_as_token_ids, ns.enable_tokenizer_info_endpoint,
                    ns.enable_server_load_tracking)
    paths = [route.path for route in app.routes]  # type: ignore[attr-defined]  # every route here has a path
    routes = ", ".join(sorted(path for path in paths if not path.startswith(("/docs", "/redoc", "/openapi"))))
    logger.info("Routes: %s", routes)
    stats, block_size = engine.get_stats(), config.cache_config.block_size
    logger.info("Ready on http://%s:%d: model %r (%s), context %d tokens, KV cache %d tokens (%d blocks of %d)",
                host, port, model.name, config.model_config.model, config.model_config.max_model_len,
                stats.num_total_blocks * block_size, stats.num_total_blocks, block_size)
    uv_config = uvicorn.Config(app, log_level=ns.uvicorn_log_level, lifespan="off",
                               timeout_graceful_shutdown=max(ns.shutdown_timeout, 0.0) + DRAIN_GRACE_S)
    server = _Server(uv_config, engine, state, ns.shutdown_timeout)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_exit_on_engine_death(engine, server)),
             loop.create_task(log_stats_periodically(engine.get_stats))]
    try:
        await server.serve(sockets=[sock])
    finally:
        for task in tasks:
            task.cancel()
        engine.shutdown()
        sock.close()
    logger.info("Server stopped")
    return 1 if engine.is_dead else 0


async def _exit_on_engine_death(engine: AsyncLLM, server: uvicorn.Server) -> None:
    await engine.dead_event.wait()
    logger.error("The engine is dead (%s); the server exits in %.0f s", engine.dead_reason, DEAD_ENGINE_EXIT_DELAY_S)
    await asyncio.sleep(DEAD_ENGINE_EXIT_DELAY_S)
    server.should_exit = True


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                        datefmt="%m-%d %H:%M:%S")


def run(ns: argparse.Namespace) -> int:
    configure_logging()
    return asyncio.run(run_server(ns))


def main(argv: list[str] | None = None) -> int:
    return run(make_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
