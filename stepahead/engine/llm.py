"""LLM: offline generation and chat.

The engine loop runs in the caller's process, with no engine process of its own (docs/design.md,
"Process layout").
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.input_processor import InputProcessor, PromptType
from stepahead.engine.output_processor import OutputProcessor, RequestOutputKind
from stepahead.errors import EngineDeadError
from stepahead.outputs import EngineStats, RequestOutput
from stepahead.request import Request
from stepahead.sampling_params import SamplingParams
from stepahead.tracing import TraceEvent
from stepahead.validation import InvalidInputError

Conversation = list[dict[str, Any]]


class LLM:
    """vLLM-compatible offline API. LLM(model=None, **EngineArgs fields); model=None is the built-in model."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from stepahead.engine.core import EngineCore
        from stepahead.executor import make_executor
        from stepahead.models.loading.loader import load_tokenizer

        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; valid ones: {EngineArgs.field_names()}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        # The tokenizer loads while the worker loads the weights (both take seconds for a GGUF model).
        with ThreadPoolExecutor(1, thread_name_prefix="stepahead-tokenizer") as pool:
            tokenizer_future = pool.submit(load_tokenizer, self.config.model_config)
            executor = make_executor(self.config)
            try:
                self.tokenizer = tokenizer_future.result()
            except BaseException:
                executor.shutdown()
                raise
        self.input_processor = InputProcessor(self.config.model_config, self.tokenizer,
                                              self.config.structured_outputs_backend, self.config.max_logprobs,
                                              self.config.scheduler_config.scheduling_policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        try:
            self.engine_core = EngineCore(self.config, executor)
            self.config = self.engine_core.config  # with the KV pool size the worker chose
        except BaseException:
            executor.shutdown()
            raise
        self._executor = executor
        self._request_counter = itertools.count()
        self._dead: BaseException | None = None
        # Garbage collection shuts the engine down too (never leaves a worker process behind).
        self._finalizer = weakref.finalize(self, _shutdown, self.engine_core, executor)

    # -- public API ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. priority: one per prompt, lower runs earlier
        (only under scheduling_policy "priority"; vLLM's keyword)."""
        prompt_list = _as_prompt_list(prompts)
        if not prompt_list:
            return []
        params_list = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidInputError(f"priority must have one entry per prompt ({len(prompt_list)}), got "
                                    f"{len(priority)}", param="priority")
        return self._run(prompt_list, params_list, use_tqdm, list(priority or [0] * len(prompt_list)))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of them.

        vLLM's keywords: `chat_template` replaces the tokenizer's, `tools` (OpenAI function tools) reach the
        template as its `tools` variable, `continue_final_message` continues the last (assistant) message
        instead of opening a new turn, and `chat_template_kwargs` are more template variables."""
        if not messages:
            raise InvalidInputError("messages must be a non-empty conversation or a list of conversations",
                                    param="messages")
        # One conversation is a list of dicts; a list of conversations, a list of lists.
        conversations = [cast(Conversation, messages)] if isinstance(messages[0], dict) \
            else list(cast(Sequence[Conversation], messages))
        prompts: list[PromptType] = [
            self.apply_chat_template(conversation, add_generation_prompt, chat_template_kwargs,
                                     chat_template=chat_template, continue_final_message=continue_final_message,
                                     tools=tools)
            for conversation in conversations]
        params_list = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm)

    def generate_stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Stream one prompt: yields DELTA RequestOutputs (new text and token ids) as tokens arrive.

        Closing the generator early (or an exception in the caller) aborts the request.
        """
        self._check_alive()
        request_id = str(next(self._request_counter))
        children, text = self.input_processor.process(request_id, prompt,
                                                      sampling_params or self.get_default_sampling_params())
        self.output_processor.add_request(request_id, children, text, RequestOutputKind.DELTA)
        finished = False
        try:
            for child in children:
                self.engine_core.add_request(child)
            while not finished:
                for request_output in self._step():  # the LLM is not reentrant: these are all this request's
                    finished = request_output.finished
                    yield request_output
            self._drain()
        finally:
            if not finished:
                self._abort([request_id])

    def apply_chat_template(
        self,
        conversation: Conversation,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A prompt dict (token ids and text) for one conversation, rendered by the chat template."""
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidInputError("this model's tokenizer has no chat template; pass chat_template= or use "
                                    "generate() with a plain prompt", param="messages")
        if add_generation_prompt and continue_final_message:
            raise InvalidInputError("continue_final_message and add_generation_prompt cannot both be true "
                                    "(pass add_generation_prompt=False to continue the last message)",
                                    param="continue_final_message")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidInputError(f"tools must be a list of tool objects (dicts), got {type(tools).__name__}",
                                    param="tools")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted({"tools", "chat_template", "tokenize", "add_generation_prompt",
                           "continue_final_message"} & set(kwargs))
        if reserved:
            raise InvalidInputError(f"chat_template_kwargs may not set {reserved}: they are chat()'s own arguments",
                                    param="chat_template_kwargs")
        if tools:
            kwargs["tools"] = tools
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if continue_final_message:
            kwargs["continue_final_message"] = True
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        # The template already holds any special tokens the model expects; do not add a BOS twice.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "prompt": text}

    def stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def drain_trace_events(self) -> list[TraceEvent]:
        """Timeline events (engine and worker lanes) recorded since the last call; needs trace=True."""
        return self.engine_core.drain_trace_events()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (see --generation-config)."""
        return SamplingParams(**self.config.model_config.generation_defaults)

    # -- the engine loop ------------------------------------------------------------------------------

    def _params_list(self, params: SamplingParams | Sequence[SamplingParams] | None,
                     num_prompts: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        params = list(params)
        if len(params) != num_prompts:
            raise InvalidInputError(f"sampling_params must be one SamplingParams or one per prompt ({num_prompts}), "
                                    f"got {len(params)}", param="sampling_params")
        return params

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             priorities: list[int] | None = None) -> list[RequestOutput]:
        self._check_alive()
        # Validate every prompt before adding any, so a bad one leaves the engine untouched.
        batch: list[tuple[str, list[Request], str | None]] = []
        for prompt, prompt_params, priority in zip(prompts, params, priorities or [0] * len(prompts), strict=True):
            request_id = str(next(self._request_counter))
            children, text = self.input_processor.process(request_id, prompt, prompt_params, priority=priority)
            batch.append((request_id, children, text))
        position = {request_id: index for index, (request_id, _, _) in enumerate(batch)}
        results: list[RequestOutput | None] = [None] * len(batch)
        added: list[str] = []
        try:
            for request_id, children, text in batch:
                self.output_processor.add_request(request_id, children, text, RequestOutputKind.FINAL_ONLY)
                added.append(request_id)
                for child in children:
                    self.engine_core.add_request(child)
            with _progress(len(batch), use_tqdm) as bar:
                while self.output_processor.has_unfinished_requests():
                    for request_output in self._step():
                        results[position[request_output.request_id]] = request_output
                        bar.update(1)
            self._drain()
        except BaseException:
            # KeyboardInterrupt or an engine failure: leave no request of this call behind.
            self._abort([request_id for request_id in added if results[position[request_id]] is None])
            raise
        return results  # type: ignore[return-value]

    def _step(self) -> list[RequestOutput]:
        if not self.engine_core.has_work():
            raise RuntimeError("stepahead engine has no work but requests are unfinished (engine bug)")
        try:
            outputs = self.engine_core.step()
        except EngineDeadError as e:
            self._dead = e
            raise
        except Exception as e:  # the engine's state is unknown after a failed step: never reuse it
            self._dead = e
            raise EngineDeadError(f"stepahead engine failed in step(): {e!r}") from e
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:  # stop strings: the frontend finished these, the engine still runs them
            self.engine_core.abort_requests(to_abort)
        return request_outputs

    def _drain(self) -> None:
        """Run the engine until idle once every request of the call has its output.

        What remains is bookkeeping: steps in flight for requests that already finished (the wasted
        step after a stop token, or a stop string's abort) and the empty step that tells the worker
        which requests finished. Draining it keeps calls independent and stats() complete.
        """
        while self.engine_core.has_work():
            self._step()

    def _abort(self, request_ids: list[str]) -> None:
        engine_ids = [engine_id for request_id in request_ids
                      for engine_id in self.output_processor.abort_request(request_id)]
        if engine_ids and self._dead is None:
            self.engine_core.abort_requests(engine_ids)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"stepahead engine died earlier and cannot serve requests: {self._dead}")
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")


def _shutdown(engine_core: Any, executor: Any) -> None:
    try:
        engine_core.shutdown()
    finally:
        executor.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """str, dict or token ids -> one prompt; a list of those -> many. A list of ints is one prompt."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(token_id, int) and not isinstance(token_id, bool) for token_id in items):
        return [cast(list[int], items)]
    return cast(list[PromptType], items)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
