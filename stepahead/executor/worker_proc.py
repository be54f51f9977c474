"""The worker process of MultiprocExecutor: a ModelRunner serving calls from a pipe, in order.

Protocol (pickled tuples). In: ("execute_model", SchedulerOutput), ("sample_tokens", GrammarOutput),
("shutdown", None). Out: ("ready", number of KV blocks allocated) once the model is loaded, then ("ok", [output, ...]): the
outputs of one or more calls, in call order; ("error", traceback text) on a failure, after which the
process exits. A closed input pipe (the engine process is gone) also ends the process, so a worker
never outlives its engine.

Every message wakes the engine process, which on a busy machine with few cores takes CPU from this
one. So an output nobody waits for yet (execute_model's None, when the step's sample_tokens call is
already queued) is held back and sent with the step's result: one message per step (under load it
shortens the worker's gap between a step's two calls: docs/BENCHMARKS.md, section 7). Held outputs
are always sent before the worker blocks for the next call, so the engine never waits on one forever.

With async outputs (CUDA) every result goes through an OutputResolver instead: its thread waits for a
step's sampled ids to reach the host and sends the result, while this thread already runs the next call.
"""

from __future__ import annotations

import os
import signal
import traceback
from multiprocessing.connection import Connection

from stepahead.config import EngineConfig
from stepahead.executor.common import RankSpec, load_runner
from stepahead.executor.output_resolver import OutputResolver

EXIT_ON_ERROR = 3


def worker_main(config: EngineConfig, num_threads: int, calls: Connection, results: Connection,
                rank: RankSpec | None = None) -> None:
    """rank: this process's place among tensor/pipeline-parallel ranks (None: the only worker). A rank
    other than the sampler sends "ready" and "error" but no outputs (the engine reads the sampler's)."""
    # Ctrl-C reaches the whole process group; the engine process decides what it means (abort a
    # request, shut down), so the worker must not die of it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_call = load_runner(config, num_threads, rank)
    except BaseException:  # reported to the engine, which raises it to the user
        results.send(("error", f"loading the model failed:\n{traceback.format_exc()}"))
        raise SystemExit(EXIT_ON_ERROR) from None
    results.send(("ready", run_call.num_kv_blocks))
    resolver = None
    if config.async_output:
        def resolve_failed(e: BaseException) -> None:
            results.send(("error", "resolving a step's output raised:\n"
                                   + "".join(traceback.format_exception(e))))
            os._exit(EXIT_ON_ERROR)  # the main thread may be blocked reading calls

        resolver = OutputResolver(lambda output: results.send(("ok", [output])), resolve_failed)
    held: list = []  # outputs not sent yet, in call order
    reports = run_call.reports_outputs
    while True:
        if held and not calls.poll():  # about to block: the engine may be waiting on these
            results.send(("ok", held))
            held = []
        try:
            method, arg = calls.recv()
        except (EOFError, OSError):
            method = "shutdown"  # the engine process closed the pipe or died
        if method == "shutdown":
            if resolver is not None:
                resolver.close()
            return
        try:
            output = run_call(method, arg)
        except BaseException:  # the state is unknown after a failure: report and exit
            if resolver is not None:
                resolver.close()  # its thread stops sending before this one does
            results.send(("error", f"{method} raised:\n{traceback.format_exc()}"))
            raise SystemExit(EXIT_ON_ERROR) from None
        if resolver is not None:
            resolver.put(output)
            continue
        if not reports:
            if output is not None and output.trace_events:  # a pipeline stage's timeline lane
                results.send(("trace", output.trace_events))
            continue
        held.append(output)
        if output is not None:  # a step's result: the engine needs it to schedule the step after next
            results.send(("ok", held))
            held = []
