"""Executors with the real ModelRunner on a tiny model: ordering, failures, worker death, shutdown."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from stepahead.core.async_scheduler import AsyncScheduler
from stepahead.engine.arg_utils import EngineArgs
from stepahead.executor import make_executor
from stepahead.executor.abstract import WorkerError
from stepahead.executor.mp import MultiprocExecutor
from stepahead.executor.spawn import stop_process
from stepahead.executor.uni import UniProcExecutor
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _config(model, executor):
    return EngineArgs(model=str(model), executor=executor, device="cpu", max_model_len=128,
                      num_kv_blocks=64).create_engine_config()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (it only waits for its parent to reap it).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _run_pipelined(executor, config, depth=3, steps=8):
    """Keep `depth` steps in flight, as EngineCore does; return the sampled tokens per request."""
    sched = AsyncScheduler(config.scheduler_config, config.cache_config)
    for i, n in enumerate((5, 20, 37)):
        sched.add_request(Request(f"r{i}", list(range(3 + i, 3 + i + n)), SamplingParams(temperature=0.0,
                                  max_tokens=steps), eos_token_id=None))
    in_flight: list[tuple[object, Future, Future]] = []
    resolved_order: list[int] = []
    tokens: dict[str, list[int]] = {}
    seq = 0
    while sched.has_requests() or in_flight:
        if sched.has_requests() and len(in_flight) < depth:
            so = sched.schedule()
            exec_fut = executor.execute_model(so)
            fut = executor.sample_tokens(None) if so.total_num_scheduled_tokens else exec_fut
            assert isinstance(fut, Future) and isinstance(exec_fut, Future)
            fut.add_done_callback(lambda _f, k=seq: resolved_order.append(k))
            seq += 1
            in_flight.append((so, exec_fut, fut))
            continue
        so, exec_fut, fut = in_flight.pop(0)
        out = fut.result(timeout=60)
        assert exec_fut.done()
        for o in sched.update_from_output(so, out):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert resolved_order == sorted(resolved_order)
    return tokens


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama):
    config = _config(tiny_llama, "uni")
    executor = UniProcExecutor(config)
    try:
        return _run_pipelined(executor, config, depth=1)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("kind", ["uni", "mp"])
def test_pipelined_calls_resolve_in_order(tiny_llama, reference_tokens, kind):
    config = _config(tiny_llama, kind)
    executor = make_executor(config)
    try:
        assert isinstance(executor, UniProcExecutor if kind == "uni" else MultiprocExecutor)
        assert _run_pipelined(executor, config, depth=3) == reference_tokens
    finally:
        executor.shutdown()


def test_held_back_output_is_sent_when_the_worker_would_block(tiny_llama):
    """The mp worker holds execute_model's None back while sample_tokens is queued; the synchronous
    pattern waits on execute_model before sending sample_tokens, so the worker must send it anyway."""
    config = _config(tiny_llama, "mp")
    executor = MultiprocExecutor(config)
    try:
        sched = AsyncScheduler(config.scheduler_config, config.cache_config)
        sched.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=3), eos_token_id=None))
        for _ in range(2):  # the synchronous pattern; then both calls queued together
            so = sched.schedule()
            assert executor.execute_model(so).result(timeout=60) is None
            out = executor.sample_tokens(None).result(timeout=60)
            assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1
            sched.update_from_output(so, out)
        so = sched.schedule()
        exec_fut, fut = executor.execute_model(so), executor.sample_tokens(None)
        assert fut.result(timeout=60).req_ids == ["r"]
        assert exec_fut.done() and exec_fut.result() is None
    finally:
        executor.shutdown()


@pytest.mark.parametrize("kind", ["uni", "mp"])
def test_worker_error_fails_pending_and_later_calls(tiny_llama, kind):
    executor = make_executor(_config(tiny_llama, kind))
    try:
        bad = executor.sample_tokens(None)  # no execute_model before it: the runner raises
        with pytest.raises(WorkerError, match="sample_tokens.*without a preceding execute_model"):
            bad.result(timeout=60)
        with pytest.raises(WorkerError, match="stepahead worker"):
            executor.sample_tokens(None).result(timeout=60)
        with pytest.raises(WorkerError):
            executor.check_health()
        if kind == "mp":
            executor._procs[0].join(timeout=30)
            assert not executor._procs[0].is_alive()
    finally:
        executor.shutdown()


def test_killed_worker_resolves_pending_futures(tiny_llama):
    config = _config(tiny_llama, "mp")
    executor = MultiprocExecutor(config)
    pid = executor.worker_pid
    try:
        sched = AsyncScheduler(config.scheduler_config, config.cache_config)
        sched.add_request(Request("r", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=None))
        os.kill(pid, signal.SIGSTOP)  # the calls below stay pending in the stopped worker
        pending = [executor.execute_model(sched.schedule()), executor.sample_tokens(None)]
        os.kill(pid, signal.SIGKILL)
        for fut in pending:
            with pytest.raises(WorkerError, match=rf"worker process \(pid {pid}\) died unexpectedly \(killed by signal 9\)"):
                fut.result(timeout=60)
        with pytest.raises(WorkerError, match="died unexpectedly"):
            executor.sample_tokens(None).result(timeout=60)
    finally:
        executor.shutdown()
    assert not _pid_alive(pid)


def test_idle_worker_death_is_reported_once(tiny_llama):
    """With no call pending, a killed worker still reaches the notify_on_failure callback, once; a callback
    registered after the death is called at once; a shutdown is no failure."""
    executor = MultiprocExecutor(_config(tiny_llama, "mp"))
    pid = executor.worker_pid
    try:
        reports: queue.Queue = queue.Queue()
        executor.notify_on_failure(reports.put)
        os.kill(pid, signal.SIGKILL)
        err = reports.get(timeout=60)
        assert isinstance(err, WorkerError) and "killed by signal 9" in str(err)
        late: queue.Queue = queue.Queue()
        executor.notify_on_failure(late.put)
        assert late.get_nowait() is err
        assert reports.empty()
    finally:
        executor.shutdown()
    executor = MultiprocExecutor(_config(tiny_llama, "mp"))
    reports = queue.Queue()
    executor.notify_on_failure(reports.put)
    executor.shutdown()
    assert reports.empty()


def test_shutdown_leaves_no_process_and_is_idempotent(tiny_llama):
    executor = MultiprocExecutor(_config(tiny_llama, "mp"))
    pid = executor.worker_pid
    assert _pid_alive(pid)
    executor.shutdown()
    executor.shutdown()
    assert not _pid_alive(pid)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.sample_tokens(None).result(timeout=10)


def test_worker_exits_when_engine_process_dies(tiny_llama):
    script = textwrap.dedent(f"""
        import os, signal
        from stepahead.engine.arg_utils import EngineArgs
        from stepahead.executor.mp import MultiprocExecutor
        cfg = EngineArgs(model={str(tiny_llama)!r}, executor="mp", device="cpu", max_model_len=128,
                         num_kv_blocks=64).create_engine_config()
        ex = MultiprocExecutor(cfg)
        print(ex.worker_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pid = int(proc.stdout.strip())
    for _ in range(600):  # the orphan sees its input pipe close and exits; bounded wait, not a timing check
        if not _pid_alive(pid):
            break
        time.sleep(0.1)
    assert not _pid_alive(pid)


def test_startup_failure_is_reported(tiny_model_factory, tmp_path):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_factory("llama"), folder)
    config = _config(folder, "mp")
    (folder / "model.safetensors").write_bytes(b"not weights")  # breaks after the config was read
    with pytest.raises(WorkerError, match="worker process failed to start: loading the model failed"):
        MultiprocExecutor(config)
    with pytest.raises(Exception):  # noqa: B017 - uni raises the loader's own error, whatever its type
        UniProcExecutor(config)


def test_script_without_main_guard_starts_one_worker(tiny_llama, tmp_path):
    """spawn would re-run an unguarded script in the worker; the executor keeps it from doing so."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from stepahead.engine.arg_utils import EngineArgs
        from stepahead.executor.mp import MultiprocExecutor
        print("script body ran", flush=True)
        cfg = EngineArgs(model={str(tiny_llama)!r}, executor="mp", device="cpu", max_model_len=128,
                         num_kv_blocks=64).create_engine_config()
        ex = MultiprocExecutor(cfg)
        ex.shutdown()
        print("done", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "script body ran\ndone\n"


def test_large_calls_and_results_cross_the_pipes(tiny_llama):
    """Steps bigger than a pipe buffer both ways (long prompts in, top-20 logprobs out): mp == uni."""
    import random

    from stepahead import LLM

    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2048) for _ in range(300)]} for _ in range(48)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=20)
    results = {}
    for kind in ("uni", "mp"):
        with LLM(str(tiny_llama), executor=kind, max_model_len=512, max_num_batched_tokens=8192) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[kind] = [(o.outputs[0].token_ids, [sorted(d) for d in o.outputs[0].logprobs]) for o in outs]
    assert results["mp"] == results["uni"]


def _sleep_until_killed(ready, ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    while True:
        time.sleep(1)


@pytest.mark.parametrize("ignore_sigterm, exitcode", [(False, -signal.SIGTERM), (True, -signal.SIGKILL)])
def test_stop_process_terminates_then_kills(ignore_sigterm, exitcode):
    """The one stop for the mp worker and the server's engine process: SIGTERM, then SIGKILL, never an orphan."""
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    proc = spawn.Process(target=_sleep_until_killed, args=(ready, ignore_sigterm), daemon=True)
    stop_process(proc, exit_wait_s=0.0, grace_s=0.5)  # never started: nothing to stop
    proc.start()
    assert ready.wait(timeout=120)
    stop_process(proc, exit_wait_s=0.0, grace_s=0.5)
    assert proc.exitcode == exitcode and not _pid_alive(proc.pid)


@pytest.mark.parametrize("user_value", [None, "ACTIVE"])
def test_worker_process_waits_passively_on_every_core_unless_told_otherwise(tiny_llama, monkeypatch, user_value):
    if user_value is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_value)
    executor = MultiprocExecutor(_config(tiny_llama, "mp"))
    try:
        environ = Path(f"/proc/{executor.worker_pid}/environ").read_bytes().split(b"\0")
        assert f"OMP_WAIT_POLICY={user_value or 'PASSIVE'}".encode() in environ
        assert os.environ.get("OMP_WAIT_POLICY") == user_value  # the engine process's own is left as it was
        cores = len(os.sched_getaffinity(0))
        # Every core when waiting is passive; one left to the engine when the user chose otherwise.
        assert executor.num_threads == (cores if user_value is None else max(1, cores - 1))
    finally:
        executor.shutdown()
