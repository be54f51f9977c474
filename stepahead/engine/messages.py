"""Messages between the API process (AsyncLLM) and the EngineCore process, msgspec-encoded over ZMQ.

Tagged unions, so each side decodes with one typed decoder and dispatches on the class. Requests
travel as their constructor arguments (the engine process rebuilds the Request), outputs as the
engine's own EngineCoreOutput dataclasses, stats as EngineStats snapshots.
"""

from __future__ import annotations

import msgspec

from stepahead.core.sched_output import EngineCoreOutput
from stepahead.outputs import EngineStats
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams

# -- API process -> engine process ----------------------------------------------------------------


class EngineRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.monotonic (one clock for every process on the machine)
    max_tokens: int  # resolved by the frontend (None in the params means the rest of the context)
    cache_salt: str | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    priority: int = 0

    @staticmethod
    def from_request(req: Request) -> EngineRequest:
        return EngineRequest(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_id,
                             req.arrival_time, req.max_tokens, req.cache_salt, req.extra_eos_token_ids, req.priority)

    def to_request(self) -> Request:
        req = Request(self.request_id, self.prompt_token_ids, self.sampling_params,
                      eos_token_id=self.eos_token_id, arrival_time=self.arrival_time, cache_salt=self.cache_salt,
                      extra_eos_token_ids=tuple(self.extra_eos_token_ids), priority=self.priority)
        req.max_tokens = self.max_tokens
        return req


class AddRequests(msgspec.Struct, tag="add"):
    requests: list[EngineRequest]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats"):
    """Ask for an EngineStats snapshot now (answered between steps)."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


EngineInput = AddRequests | AbortRequests | GetStats | Shutdown


# -- engine process -> API process ----------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready"):
    pid: int
    worker_pid: int | None  # the executor's worker process (mp), for operators and tests
    stats: EngineStats


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats | None = None
    step_tokens: list[int] = []  # tokens of each step since the last message (iteration_tokens_total)


class EngineFailed(msgspec.Struct, tag="failed"):
    """Sent once before the engine process exits on an error; no message follows."""

    message: str
    during_startup: bool = False


EngineOutput = EngineReady | EngineOutputs | EngineFailed


class Codec:
    """One encoder and the two typed decoders; create one per process (not thread-safe to share)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._input_decoder = msgspec.msgpack.Decoder(EngineInput)
        self._output_decoder = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, msg: EngineInput | EngineOutput) -> bytes:
        return self._encoder.encode(msg)

    def decode_input(self, data: bytes) -> EngineInput:
        return self._input_decoder.decode(data)

    def decode_output(self, data: bytes) -> EngineOutput:
        return self._output_decoder.decode(data)
