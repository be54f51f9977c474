"""The scripted executor for EngineCore tests: a real worker thread, real futures, per-request state.

FakeExecutor adds a call log and an overlap probe on top of stepahead.tools.scripted_worker: when
`hold_s` > 0, the worker holds each sampling call until the engine has submitted the next step's
execute_model (or hold_s passes), and counts how often that happened, so a test can show that step
N+1 was launched while step N was still unresolved.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from stepahead.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from stepahead.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from stepahead.engine.core import EngineCore
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.tools.scripted_worker import ScriptedExecutor, ScriptedModel

EOS = 2


class FakeExecutor(ScriptedExecutor):
    def __init__(self, model: ScriptedModel, block_size: int, num_blocks: int, hold_s: float = 0.0,
                 **kw) -> None:
        super().__init__(model, block_size, num_blocks, **kw)
        self.log: list[tuple[str, int]] = []
        self.hold_s = hold_s
        self.overlapped = 0
        self._cond = threading.Condition()
        self._num_exec_submitted = 0
        self._num_sampled = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput | None]:
        with self._cond:
            self.log.append(("execute", scheduler_output.step_id))
            self._num_exec_submitted += 1
            self._cond.notify_all()
        return super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> Future[ModelRunnerOutput]:
        self.log.append(("sample", 0))
        return super().sample_tokens(grammar_output)

    def _sample(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self.hold_s:
            with self._cond:
                self._num_sampled += 1
                if self._cond.wait_for(lambda: self._num_exec_submitted > self._num_sampled, self.hold_s):
                    self.overlapped += 1
        return super()._sample(grammar_output)


def make_model_config(max_model_len: int) -> ModelConfig:
    return ModelConfig(model="scripted", architecture="ScriptedForCausalLM", hf_config={}, dtype="float32",
                       max_model_len=max_model_len, vocab_size=1000, num_layers=1, num_kv_heads=1,
                       head_dim=8, eos_token_id=EOS)


def make_engine(*, async_scheduling: bool = True, depth: int | None = None, block_size: int = 4,
                num_blocks: int = 128, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 256,
                caching: bool = True, trace: bool = False, eos_at: dict | None = None,
                num_spec_tokens: int = 0, **executor_kw) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        model_config=make_model_config(max_model_len),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                         max_model_len=max_model_len, debug_invariants=True,
                                         num_speculative_tokens=num_spec_tokens),
        cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 enable_prefix_caching=caching),
        async_scheduling=async_scheduling,
        max_concurrent_batches=depth if depth is not None else (2 if async_scheduling else 1),
        executor="uni", device="cpu", trace=trace,
        # The scripted model has no tokenizer to compile grammars against: steps holding a grammar
        # still defer their sampling, unconstrained.
        structured_outputs_backend="none",
    )
    executor = FakeExecutor(ScriptedModel(eos_token_id=EOS, eos_at=dict(eos_at or {})), block_size, num_blocks,
                            num_speculative_tokens=num_spec_tokens, **executor_kw)
    return EngineCore(config, executor), executor


def request(rid: str, prompt: list[int], max_tokens: int | None = 8, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS)


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step until idle; return tokens and finish reasons per request, checking delivery order (I8)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return tokens, reasons
        for o in core.step():
            assert o.request_id not in reasons, f"output after finish: {o}"
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
    raise AssertionError("engine did not become idle")
