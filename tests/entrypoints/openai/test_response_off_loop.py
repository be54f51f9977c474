"""A large non-streamed response (an echoed prompt with logprobs, prompt_logprobs) is built off the
event loop: the server answers /health while it is being built. The real app on a real AsyncLLM, in
process; the completions endpoint's own `response` hook is wrapped so that, once building has begun, it
waits for the test to have had /health answered. Built on the event loop, that could never happen (the
wait would hold the loop): the ordering itself is the check, the timeout only a guard against hanging."""

from __future__ import annotations

import asyncio
import threading

import httpx

from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.async_llm import AsyncLLM
from stepahead.entrypoints.openai.api_server import build_app, served_model
from stepahead.entrypoints.openai.serving_completions import OpenAIServingCompletion

HANG_GUARD_S = 120  # never reached when the response is built off the loop


def test_health_is_answered_while_a_large_echo_is_built(tiny_llama, monkeypatch):
    building = threading.Event()
    health_answered = threading.Event()
    waited: list[bool] = []
    real_response = OpenAIServingCompletion.response

    def response(self, *args, **kwargs):
        building.set()
        waited.append(health_answered.wait(HANG_GUARD_S))
        return real_response(self, *args, **kwargs)

    monkeypatch.setattr(OpenAIServingCompletion, "response", response)
    args = EngineArgs(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, executor="uni", num_threads=1)

    async def main() -> None:
        engine = await AsyncLLM.from_engine_args(args)
        try:
            app = build_app(engine, served_model(engine, "x", str(tiny_llama)))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=HANG_GUARD_S * 2) as client:
                prompt = "def main(argv):\n    parser = argparse.ArgumentParser()\n" * 12
                big = asyncio.create_task(client.post("/v1/completions", json={
                    "model": "x", "prompt": prompt, "echo": True, "logprobs": 5, "prompt_logprobs": 5,
                    "max_tokens": 0}))
                while not building.is_set():
                    await asyncio.sleep(0.01)
                health = await client.get("/health")
                assert health.status_code == 200
                health_answered.set()
                resp = await big
        finally:
            engine.shutdown()
        assert waited == [True]  # /health was answered while the response was being built
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        n = resp.json()["usage"]["prompt_tokens"]
        assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == n
        assert len(choice["prompt_logprobs"]) == n and choice["prompt_logprobs"][0] is None

    asyncio.run(main())
