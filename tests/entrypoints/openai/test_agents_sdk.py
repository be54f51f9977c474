"""A real agent framework drives a tool loop against `stepahead serve` on the built-in model: the OpenAI
Agents SDK (openai-agents, pinned in the dev extras), offline, its tracing off.

The first turn forces a call (tool_choice "required": the grammar makes it parse and validate); the SDK
runs the Python function, sends its result back as a role "tool" message, drops tool_choice for the next
turn (its reset_tool_choice default) and the model answers in text, which ends the loop. Every request
body the SDK sends is recorded from its own httpx client, so the test reads what went over the wire."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

agents = pytest.importorskip("agents")  # the dev extras pin it; a plain install may lack it

from stepahead.models.loading.loader import builtin_model_path  # noqa: E402
from tests.entrypoints.openai.server_utils import RemoteServer  # noqa: E402

CITIES = {"Paris": 21, "Oslo": 4, "Tokyo": 17}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(builtin_model_path(), "--served-model-name", "x", "--max-model-len", "1024",
                       "--executor", "uni", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    srv.stop()


def _agent(server: RemoteServer, bodies: list[dict], calls: list[dict]):
    """The agent, its model over an AsyncOpenAI client whose every request body lands in `bodies`."""
    agents.set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI

    async def record(request: httpx.Request) -> None:
        bodies.append(json.loads(request.content))

    http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, http_client=http)

    @agents.function_tool
    def get_temperature(city: str) -> str:
        """The temperature in a city, in degrees Celsius.

        Args:
            city: The city's name.
        """
        calls.append({"city": city})
        return json.dumps({"city": city, "celsius": CITIES.get(city, 12)})

    model = agents.OpenAIChatCompletionsModel(model="x", openai_client=client)
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=48)
    agent = agents.Agent(name="weather", instructions="Answer with the temperature the tool gives.",
                         tools=[get_temperature], model=model, model_settings=settings)
    return agent, get_temperature, http


def test_agent_calls_the_tool_and_answers(server):
    bodies: list[dict] = []
    calls: list[dict] = []
    agent, tool, http = _agent(server, bodies, calls)

    async def run():
        try:
            return await agents.Runner.run(agent, "How warm is it in Paris?", max_turns=4)
        finally:
            await http.aclose()

    result = asyncio.run(run())

    # The tool ran once, with arguments that validate against the schema the SDK advertised.
    assert len(calls) == 1
    jsonschema.validate(calls[0], tool.params_json_schema)
    first, second = bodies[0], bodies[-1]
    assert first["tool_choice"] == "required"
    assert [t["function"]["name"] for t in first["tools"]] == ["get_temperature"]
    # The loop ended after two model turns: the call, then the answer.
    assert len(bodies) == 2 and "tool_choice" not in second
    call_message = next(m for m in second["messages"] if m["role"] == "assistant" and m.get("tool_calls"))
    (call,) = call_message["tool_calls"]
    assert call["function"]["name"] == "get_temperature"
    assert json.loads(call["function"]["arguments"]) == calls[0]
    tool_message = next(m for m in second["messages"] if m["role"] == "tool")
    assert tool_message["tool_call_id"] == call["id"]
    assert json.loads(tool_message["content"])["city"] == calls[0]["city"]
    # The model's answer is the run's final output, in text.
    assert isinstance(result.final_output, str) and result.final_output
    assert result.final_output == result.new_items[-1].raw_item.content[0].text
