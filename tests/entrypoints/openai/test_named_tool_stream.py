"""A named tool call streamed: one entry per call in each delta (clients read tool_calls[0] of a chunk), the
first text going out with the call's id and name, the rest as arguments only."""

from __future__ import annotations

from stepahead.entrypoints.openai.tool_calling.constrained import NamedToolStream


def test_one_entry_per_delta_and_the_arguments_whole():
    stream = NamedToolStream("get_weather")
    deltas = [stream.feed(piece).tool_calls for piece in ('{"', 'city', '": "Rome"}', "")]
    assert all(len(entries) <= 1 for entries in deltas)
    first = deltas[0][0]
    assert first["id"] and first["function"] == {"name": "get_weather", "arguments": '{"'}
    assert "".join(d[0]["function"]["arguments"] for d in deltas if d) == '{"city": "Rome"}'
    assert "name" not in deltas[1][0]["function"]
