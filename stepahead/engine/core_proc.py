"""The EngineCore process of the server: builds the executor and runs the busy loop.

    input thread:  ZMQ PULL -> decode -> queue            (never touches the core)
    main thread:   step while the core has work, else block on the queue; send each step's outputs

Everything the core is told goes through one queue, in arrival order, and is applied between steps,
so an abort can never overtake the add it refers to. The mp executor also puts a _WorkerFailed there
when its worker dies, so an idle engine fails (EngineFailed, exit) instead of waiting for a request. The process ignores SIGINT (a Ctrl-C in the
terminal reaches the whole process group; the API server decides how to shut down and tells us),
exits on SIGTERM, and dies with its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

import zmq

from stepahead.config import EngineConfig
from stepahead.core.sched_output import EngineCoreOutput
from stepahead.engine import messages
from stepahead.engine.chrome_trace import write_trace
from stepahead.engine.core import EngineCore
from stepahead.executor.abstract import WorkerError
from stepahead.tracing import TraceEvent

logger = logging.getLogger("stepahead.engine.core_proc")

_PR_SET_PDEATHSIG = 1
EXIT_ENGINE_FAILED = 3


@dataclass
class _WorkerFailed:
    """Put in the input queue by the executor's reader thread when the worker dies."""

    error: RuntimeError


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    trace_path: str | None = None) -> None:
    """Entry point of the spawned engine process."""
    _prepare_process(parent_pid)
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 5000)
    out_sock.connect(output_addr)
    try:
        code = _serve(config, ctx, input_addr, _Outbox(out_sock), trace_path)
    finally:
        out_sock.close()
        ctx.term()
    sys.exit(code)


class _Outbox:
    """The socket to the API process with the encoder of this process (the main thread's only)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._codec = messages.Codec()

    def send(self, msg: messages.EngineOutput) -> None:
        self._sock.send(self._codec.encode(msg))


def _serve(config: EngineConfig, ctx: zmq.Context, input_addr: str, outbox: _Outbox, trace_path: str | None) -> int:
    from stepahead.executor import make_executor
    from stepahead.executor.submitting import SubmittingExecutor

    try:
        executor = make_executor(config)
        try:
            core = EngineCore(config, executor)
        except BaseException:
            executor.shutdown()
            raise
    except BaseException as e:  # reported to the API process, which exits with it
        outbox.send(messages.EngineFailed(_describe(e), during_startup=True))
        return EXIT_ENGINE_FAILED
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.bind(input_addr)  # before "ready"; the reader thread owns the socket from here on
    inbox: queue.Queue = queue.Queue()
    if isinstance(executor, SubmittingExecutor):  # every executor but the scripted one
        executor.notify_on_failure(lambda error: inbox.put(_WorkerFailed(error)))
    reader = threading.Thread(target=_read_inputs, args=(in_sock, inbox),
                              name="stepahead-engine-input", daemon=True)
    reader.start()
    outbox.send(messages.EngineReady(os.getpid(), getattr(executor, "worker_pid", None), core.get_stats()))
    trace_events: list[TraceEvent] | None = [] if trace_path else None
    try:
        _busy_loop(core, inbox, outbox, trace_events)
    except SystemExit:
        pass  # SIGTERM: shut down below
    except BaseException as e:  # engine death: tell the API process, then exit
        # A dead worker (the idle path raises its WorkerError as is) needs no traceback of ours.
        logger.error("EngineCore failed: %s", e if isinstance(e, WorkerError) else _describe(e))
        with contextlib.suppress(zmq.ZMQError):
            # EngineDeadError carries one "error" output per unfinished request: deliver them first.
            error_outputs = getattr(e, "outputs", None)
            if error_outputs:
                outbox.send(messages.EngineOutputs(error_outputs))
            outbox.send(messages.EngineFailed(str(e) or repr(e)))
        _shutdown_core(core, trace_path, trace_events)
        return EXIT_ENGINE_FAILED
    _shutdown_core(core, trace_path, trace_events)
    return 0


def _busy_loop(core: EngineCore, inbox: queue.Queue, outbox: _Outbox, trace_events: list[TraceEvent] | None) -> None:
    while True:
        if not core.has_work():
            # Going idle: the last snapshot must show the engine empty (0 running, blocks freed).
            outbox.send(messages.EngineOutputs([], core.get_stats(), core.take_step_tokens()))
            if not _apply(core, inbox.get(), outbox):
                return
        while True:
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                break
            if not _apply(core, msg, outbox):
                return
        if not core.has_work():
            continue
        outputs = core.step()
        if trace_events is not None:
            trace_events.extend(core.drain_trace_events())
        if outputs:
            outbox.send(messages.EngineOutputs(outputs, core.get_stats(), core.take_step_tokens()))


def _apply(core: EngineCore, msg: messages.EngineInput | _WorkerFailed, outbox: _Outbox) -> bool:
    """Apply one input message; False means shut down."""
    if isinstance(msg, _WorkerFailed):
        if not core.has_work():
            raise msg.error
        # Otherwise the next step fails on the dead worker and finishes every request with "error".
    elif isinstance(msg, messages.AddRequests):
        rejected = []
        for engine_request in msg.requests:
            try:
                core.add_request(engine_request.to_request())
            except ValueError as e:
                # The frontend validated already; a late rejection still finishes the request.
                logger.warning("EngineCore rejected request %s: %s", engine_request.request_id, e)
                rejected.append(_error_output(engine_request.request_id, str(e)))
        if rejected:
            outbox.send(messages.EngineOutputs(rejected))
    elif isinstance(msg, messages.AbortRequests):
        core.abort_requests(msg.request_ids)
    elif isinstance(msg, messages.GetStats):
        outbox.send(messages.EngineOutputs([], core.get_stats()))
    elif isinstance(msg, messages.Shutdown):
        return False
    return True


def _error_output(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason="error", stop_reason=message)


def _read_inputs(sock: zmq.Socket, inbox: queue.Queue) -> None:
    codec = messages.Codec()  # this thread's own decoder
    try:
        while True:
            try:
                data = sock.recv()
            except zmq.ContextTerminated:
                return
            try:
                inbox.put(codec.decode_input(data))
            except Exception:  # a malformed message must not kill the engine
                logger.exception("EngineCore dropped an undecodable input message")
    finally:
        sock.close()


def _shutdown_core(core: EngineCore, trace_path: str | None, trace_events: list[TraceEvent] | None) -> None:
    try:
        core.shutdown()
    except Exception:  # best effort on the way out
        logger.exception("EngineCore shutdown failed")
    if trace_path and trace_events is not None:
        _write_trace(trace_path, trace_events)


def _write_trace(path: str, events: list[TraceEvent]) -> None:
    try:
        write_trace(path, [("stepahead serve", events)])
        logger.info("Wrote %d trace events to %s", len(events), path)
    except Exception:  # a trace is a diagnostic; never fail the shutdown on it
        logger.exception("Writing the trace to %s failed", path)


def _prepare_process(parent_pid: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [EngineCore pid=%(process)d] "
                        "%(message)s", datefmt="%m-%d %H:%M:%S")
    # SIG_IGN is inherited by the worker the executor spawns, so Ctrl-C reaches neither.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_exit)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(EXIT_ENGINE_FAILED)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(0)


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)).strip()
