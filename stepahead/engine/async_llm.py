"""AsyncLLM: the API server's client of an EngineCore running in its own process.

Tokenization, validation, detokenization and stop strings happen here, in the API process; the
engine process only schedules and steps (core_proc.py). One asyncio task reads the engine's output
socket, runs the OutputProcessor and routes each RequestOutput to the RequestStream that owns it.

A RequestStream can hold several parent requests (the prompts of one HTTP request), so one consumer
reads them all from a single queue. Leaving `stream_outputs` early (client disconnect, cancellation)
aborts every unfinished request of the stream in the engine.

If the engine process fails or disappears, every stream gets EngineDeadError, `is_dead` turns true
and `dead_event` is set, so the server can report unhealthy and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from stepahead.config import EngineConfig
from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.core_proc import run_engine_core
from stepahead.engine.input_processor import InputProcessor, PromptType
from stepahead.engine.messages import (
    AbortRequests,
    AddRequests,
    Codec,
    EngineFailed,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    Shutdown,
)
from stepahead.engine.output_processor import OutputProcessor, RequestOutputKind
from stepahead.errors import EngineDeadError, EngineShutdownError
from stepahead.executor.spawn import main_module_hidden, stop_process
from stepahead.outputs import EngineStats, RequestOutput
from stepahead.sampling_params import SamplingParams
from stepahead.validation import InvalidInputError

logger = logging.getLogger("stepahead.engine.async_llm")

_POLL_MS = 500  # how often the output loop checks that the engine process is alive
_SHUTDOWN_GRACE_S = 10.0
_SOCKET_CONNECT_WAIT_MS = 5000  # after "ready", for the input socket to connect (zmq retries every 100 ms)


@dataclass
class RequestStream:
    """The outputs of one or more parent requests, delivered through one queue."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | BaseException
    request_ids: list[str] = field(default_factory=list)
    unfinished: set[str] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return not self.unfinished


@dataclass
class FinishedRequest:
    finish_reason: str
    e2e_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # vLLM's request phases, from arrival, first scheduling, first token and finish (None where the
    # request never reached that point): waiting, prefill, decode, and prefill plus decode.
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    n: int = 1  # the request's sampling parameters
    max_tokens: int | None = None


@dataclass
class IterationStats:
    """What one batch of engine outputs meant for latency metrics (measured in the API process)."""

    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens of each engine step since the last batch


@dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int
    n: int = 1
    max_tokens: int | None = None
    scheduled: float | None = None  # first scheduled (the engine's clock: time.monotonic on this machine)
    first_token: float | None = None
    last_token: float | None = None
    tokens_per_choice: dict[int, int] = field(default_factory=dict)

    def finished(self, reason: str, now: float, index: int | None = None) -> FinishedRequest:
        tokens = self.tokens_per_choice.get(index, 0) if index is not None else sum(self.tokens_per_choice.values())
        scheduled, first = self.scheduled, self.first_token
        return FinishedRequest(
            reason, now - self.arrival, self.num_prompt_tokens, tokens,
            queue_s=None if scheduled is None else max(scheduled - self.arrival, 0.0),
            prefill_s=None if scheduled is None or first is None else max(first - scheduled, 0.0),
            decode_s=None if first is None else now - first,
            inference_s=None if scheduled is None else max(now - scheduled, 0.0),
            n=self.n, max_tokens=self.max_tokens)


StatsListener = Callable[[IterationStats, EngineStats | None], None]


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer=None, *, trace_path: str | None = None) -> None:
        from stepahead.models.loading.loader import load_tokenizer

        self.config = config
        self.model_config = config.model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_config)
        self.input_processor = InputProcessor(config.model_config, self.tokenizer, config.structured_outputs_backend,
                                              config.max_logprobs, config.scheduler_config.scheduling_policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats_listeners: list[StatsListener] = []
        self.dead_event = asyncio.Event()
        self.dead_reason: str | None = None
        self.engine_pid: int | None = None
        self.worker_pid: int | None = None
        self._stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._closed = False
        self._output_task: asyncio.Task | None = None
        self._codec = Codec()

        self._tmpdir = tempfile.mkdtemp(prefix="stepahead-ipc-")
        input_addr, output_addr = f"ipc://{self._tmpdir}/input", f"ipc://{self._tmpdir}/output"
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        # Connecting (not binding) makes the pipe exist at once: sends queue until the engine binds,
        # instead of failing with EAGAIN while no peer is attached. The monitor says when it has.
        self._input_connected = self._input.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._input.connect(input_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)

        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(target=run_engine_core, name="stepahead-engine-core",
                                   args=(config, input_addr, output_addr, os.getpid(), trace_path))
        with main_module_hidden():
            self._proc.start()
        # A library user who forgets shutdown() still leaves no engine process behind.
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._tmpdir)

    @classmethod
    async def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> AsyncLLM:
        llm = cls(engine_args.create_engine_config(), **kwargs)
        try:
            await llm.start()
        except BaseException:
            llm.shutdown()
            raise
        return llm

    async def start(self, timeout_s: float | None = None) -> None:
        """Wait until the engine process has loaded the model, then start routing its outputs."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if await self._output.poll(_POLL_MS):
                msg = self._codec.decode_output(await self._output.recv())
                if isinstance(msg, EngineReady):
                    self.engine_pid, self.worker_pid, self._stats = msg.pid, msg.worker_pid, msg.stats
                    self._remove_socket_files()
                    break
                if isinstance(msg, EngineFailed):
                    self._proc.join(timeout=_SHUTDOWN_GRACE_S)
                    raise EngineDeadError(f"The engine process failed to start:\n{msg.message}")
            elif not self._proc.is_alive():
                raise EngineDeadError(f"The engine process exited during startup (exit code {self._proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"The engine process did not become ready within {timeout_s} s")
        self._output_task = asyncio.get_running_loop().create_task(self._output_loop(), name="stepahead-outputs")

    def _remove_socket_files(self) -> None:
        """Both connections are made once the engine is ready and the input socket has connected;
        the socket files are never needed again. Removing them now means no exit path (a kill -9
        included) leaves them behind. The engine bound its input just before it said ready, so the
        connection follows within a reconnect interval."""
        connected = self._input_connected.poll(_SOCKET_CONNECT_WAIT_MS)
        self._input.disable_monitor()
        self._input_connected.close()
        if connected:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- requests ----------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    stream: RequestStream | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Validate and submit one prompt (its n children); raises InvalidInputError (a ValueError) on bad input.

        Pass the same stream for several prompts to read all their outputs from one queue.
        """
        self._check_alive()
        if request_id in self._timings:
            raise InvalidInputError(f"Request id {request_id!r} is already running", param="request_id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children, prompt_text = self.input_processor.process(request_id, prompt, params, arrival, priority,
                                                             cache_salt)
        stream = stream if stream is not None else RequestStream()
        self.output_processor.add_request(request_id, children, prompt_text, RequestOutputKind.DELTA)
        self._streams[request_id] = stream
        self._timings[request_id] = _Timing(arrival, len(children[0].prompt_token_ids), params.n, params.max_tokens)
        stream.request_ids.append(request_id)
        stream.unfinished.add(request_id)
        self._send(AddRequests([EngineRequest.from_request(child) for child in children]))
        return stream

    async def stream_outputs(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """Yield the stream's RequestOutputs (DELTA) until all its requests finish.

        Raises EngineDeadError if the engine dies. Closing or cancelling the iteration early aborts
        every unfinished request of the stream.
        """
        try:
            # Also drain the queue: abort_all empties `unfinished` and then queues its reason, which a
            # consumer resuming from a yield must still see.
            while stream.unfinished or not stream.queue.empty():
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    stream.unfinished.discard(item.request_id)
                yield item
        finally:
            for request_id in list(stream.unfinished):
                self.abort(request_id)

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        stream = self.add_request(request_id, prompt, params)
        async with contextlib.aclosing(self.stream_outputs(stream)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; the engine drops it at its next step and frees its blocks."""
        engine_ids = self.output_processor.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.unfinished.discard(request_id)
        timing = self._timings.pop(request_id, None)
        if timing is not None:
            self._emit(IterationStats(finished=[timing.finished("abort", time.monotonic())]), None)
        if engine_ids and not self.is_dead:
            self._send(AbortRequests(engine_ids))

    def abort_all(self, reason: BaseException) -> None:
        """Fail every in-flight stream with `reason` and abort its requests (server shutdown)."""
        streams = {id(stream): stream for stream in self._streams.values()}
        for request_id in list(self._streams):
            self.abort(request_id)
        for stream in streams.values():
            stream.queue.put_nowait(reason)

    def get_stats(self) -> EngineStats:
        """The latest snapshot; the engine sends one with every step's outputs and when it goes idle."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- engine outputs ------------------------------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                if await self._output.poll(_POLL_MS):
                    self._handle(self._codec.decode_output(await self._output.recv()))
                    continue
                if not self._proc.is_alive():
                    # Drain what it sent before exiting, then declare it dead.
                    while await self._output.poll(0):
                        self._handle(self._codec.decode_output(await self._output.recv()))
                    if not self.is_dead and not self._closed:
                        self._set_dead(f"The engine process exited unexpectedly (exit code {self._proc.exitcode})")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave clients hanging
            logger.exception("The engine output loop failed")
            self._set_dead(f"The engine output loop failed: {e!r}")

    def _handle(self, msg) -> None:
        if isinstance(msg, EngineOutputs):
            if msg.outputs:
                self._route(msg.outputs, msg.stats, msg.step_tokens)
            elif msg.stats is not None:
                self._stats = msg.stats
                self._emit(IterationStats(step_tokens=msg.step_tokens), msg.stats)
        elif isinstance(msg, EngineFailed):
            self._set_dead(f"The engine failed: {msg.message}")

    def _route(self, engine_outputs, engine_stats: EngineStats | None, step_tokens: list[int]) -> None:
        if engine_stats is not None:
            self._stats = engine_stats
        request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:
            self._send(AbortRequests(to_abort))
        now = time.monotonic()
        iteration = IterationStats(step_tokens=step_tokens)
        for request_output in request_outputs:
            self._record_timing(request_output, now, iteration)
            stream = self._streams.get(request_output.request_id)
            if stream is None:
                continue
            if request_output.finished:
                del self._streams[request_output.request_id]
            stream.queue.put_nowait(request_output)
        self._emit(iteration, engine_stats)

    def _record_timing(self, request_output: RequestOutput, now: float, iteration: IterationStats) -> None:
        timing = self._timings.get(request_output.request_id)
        if timing is None:
            return
        if timing.scheduled is None:
            timing.scheduled = request_output.first_scheduled_time
        if any(completion.token_ids for completion in request_output.outputs):
            if timing.last_token is None:
                timing.first_token = now
                iteration.ttfts_s.append(now - timing.arrival)
            else:
                iteration.itls_s.append(now - timing.last_token)
            timing.last_token = now
        for completion in request_output.outputs:
            timing.tokens_per_choice[completion.index] = (timing.tokens_per_choice.get(completion.index, 0)
                                                          + len(completion.token_ids))
            if completion.finish_reason is not None:
                iteration.finished.append(timing.finished(completion.finish_reason, now, completion.index))
        if request_output.finished:
            del self._timings[request_output.request_id]

    def _emit(self, iteration: IterationStats, engine_stats: EngineStats | None) -> None:
        for listener in self.stats_listeners:
            try:
                listener(iteration, engine_stats)
            except Exception:  # metrics must never break serving
                logger.exception("A stats listener failed")

    # -- failure and shutdown --------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:  # is_dead
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineShutdownError("The engine has been shut down")

    def _send(self, msg) -> None:
        if self._closed:
            return
        try:
            self._input.send(self._codec.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._set_dead(f"Cannot reach the engine process: {e}")

    def _set_dead(self, reason: str) -> None:
        if self.is_dead:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        err = EngineDeadError(reason)
        for stream in {id(stream): stream for stream in self._streams.values()}.values():
            stream.queue.put_nowait(err)
        self._streams.clear()
        self._timings.clear()
        self.dead_event.set()

    def shutdown(self, timeout_s: float = _SHUTDOWN_GRACE_S) -> None:
        """Stop the engine process (and with it the worker); idempotent. No process is left behind."""
        if self._closed:
            return
        if not self.is_dead:
            with contextlib.suppress(zmq.ZMQError):
                self._input.send(self._codec.encode(Shutdown()), flags=zmq.NOBLOCK)
        self._closed = True
        shutil.rmtree(self._tmpdir, ignore_errors=True)  # first: a signal may end this process any time now
        closed = EngineShutdownError("The engine was shut down")
        for stream in {id(stream): stream for stream in self._streams.values()}.values():
            stream.queue.put_nowait(closed)
        self._streams.clear()
        if self._output_task is not None:
            self._output_task.cancel()
        stop_process(self._proc, timeout_s, _SHUTDOWN_GRACE_S)  # SIGTERM: the engine stops its executor
        self._finalizer.detach()
        self._input.close()
        self._output.close()
        self._sync_ctx.term()
        self._async_ctx.term()


def _cleanup(proc: multiprocessing.process.BaseProcess, tmpdir: str) -> None:
    shutil.rmtree(tmpdir, ignore_errors=True)
    stop_process(proc, 0.0, _SHUTDOWN_GRACE_S)
