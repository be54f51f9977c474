"""What the worker remembers about each request between steps (it receives only diffs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepahead.sampling_params import SamplingParams
from stepahead.worker.spec_decode.draft_track import DraftTrack


@dataclass
class CachedRequestState:
    """What the worker remembers about a request between steps (it only receives diffs)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + every output token this worker knows of
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    draft: DraftTrack = field(default_factory=DraftTrack)  # speculative decoding's drafting state

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def set_history(self, all_token_ids: list[int], num_output_tokens: int | None = None) -> None:
        keep = len(all_token_ids) if num_output_tokens is None else self.num_prompt_tokens + num_output_tokens
        self.token_ids = list(all_token_ids[:keep])
