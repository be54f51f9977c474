"""AsyncLLM directly: generate, abort mid-stream, id reuse, stats snapshots, clean shutdown."""

from __future__ import annotations

import asyncio

from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.async_llm import AsyncLLM
from stepahead.sampling_params import SamplingParams
from tests.entrypoints.openai.server_utils import alive

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _collect(llm: AsyncLLM, prompt, params, request_id: str) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in llm.generate(prompt, params, request_id):
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


async def _wait_idle(llm: AsyncLLM) -> None:
    for _ in range(600):
        s = llm.get_stats()
        if s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {llm.get_stats()}")


def test_async_llm(tiny_llama):
    args = EngineArgs(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, executor="mp", num_threads=1)

    async def main() -> None:
        llm = await AsyncLLM.from_engine_args(args)
        engine_pid, worker = llm.engine_pid, llm.worker_pid
        assert alive(engine_pid) and worker is not None and alive(worker)
        try:
            # Plain generation: every token exactly once, in order, n choices.
            out = await _collect(llm, "def f(x):", SamplingParams(max_tokens=9, n=3, temperature=1.0, seed=1,
                                                                  ignore_eos=True), "a")
            assert sorted(out) == [0, 1, 2] and all(len(t) == 9 for t in out.values())

            # Abort mid-stream while a long n=3 request and a short one run alongside.
            long_params = SamplingParams(max_tokens=400, **GREEDY)
            seen = 0
            gen = llm.generate("import os", long_params, "victim")
            others = asyncio.gather(
                _collect(llm, "x = 1", SamplingParams(max_tokens=30, n=3, temperature=1.0, seed=3,
                                                      ignore_eos=True), "n3"),
                _collect(llm, "y = 2", SamplingParams(max_tokens=25, **GREEDY), "short"),
            )
            async for o in gen:
                seen += len(o.outputs[0].token_ids)
                if seen >= 3:
                    break
            await gen.aclose()  # the client went away
            n3, short = await others
            assert [len(n3[i]) for i in range(3)] == [30, 30, 30] and len(short[0]) == 25
            assert not llm.output_processor.has_unfinished_requests()
            await _wait_idle(llm)
            assert llm.get_stats().finished_by_reason.get("abort", 0) >= 1

            # The aborted id can be used again and then runs to its end.
            again = await _collect(llm, "import os", SamplingParams(max_tokens=12, **GREEDY), "victim")
            assert len(again[0]) == 12

            # Bad input raises ValueError at submission and leaves the engine serving.
            for bad in ("", [10**6]):
                try:
                    await _collect(llm, bad, SamplingParams(max_tokens=2), "bad")
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"{bad!r} accepted")
            assert len((await _collect(llm, "ok", SamplingParams(max_tokens=2, **GREEDY), "ok"))[0]) == 2
            assert not llm.is_dead
        finally:
            llm.shutdown()
        assert not alive(engine_pid) and not alive(worker)

    asyncio.run(main())
