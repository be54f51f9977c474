"""transformers baselines on the same prompts: `generate` in padded static batches and `generate_batch`'s
continuous batching (its ContinuousBatchingManager, which takes a max_new_tokens per request).

Both ignore EOS so every request produces exactly its output budget, like the stepahead run they are
compared with; the figures count only the tokens each request asked for. `generate_batch` needs
transformers' ContinuousBatchingConfig (tested with 5.17 and 5.24).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from stepahead.bench.datasets import SampleRequest
from stepahead.bench.report import TokenRates
from stepahead.utils import cdiv


@dataclass
class BaselineResult(TokenRates):
    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # tokens the requests asked for and got

    def line(self) -> str:
        return (f"[{self.name}] {self.num_requests} requests, {self.output_tokens} output tokens in "
                f"{self.elapsed_s:.2f} s: output {self.output_tok_s:.1f} tok/s, total {self.total_tok_s:.1f} tok/s")

    def to_dict(self) -> dict:
        return {"name": self.name, "elapsed_s": self.elapsed_s, "num_requests": self.num_requests,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def load_hf_model(model: str | None, load_format: str = "auto"):
    """A float32 transformers model of the same checkpoint (random weights for load_format='dummy').

    GGUF files are dequantized with transformers' own GGUF reader into a model built from the
    config, which avoids from_pretrained's dependency on accelerate.
    """
    import torch
    import transformers

    from stepahead.models.loading.loader import builtin_model_path

    path = Path(builtin_model_path() if model is None else model)
    gguf_file = path.name if path.suffix == ".gguf" else None
    folder = path.parent if gguf_file else path
    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    if load_format != "dummy" and gguf_file is None:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if load_format != "dummy":
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

            tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf_model)["tensors"]
            hf_model.load_state_dict({name: torch.as_tensor(value) for name, value in tensors.items()}, strict=False)
            hf_model.tie_weights()
    return hf_model.eval()


def run_generate(hf_model, requests: list[SampleRequest], batch_size: int, pad_token_id: int = 0) -> BaselineResult:
    """transformers `generate` on left-padded static batches of batch_size, in input order.

    A static batch runs until its longest request is done, so shorter requests pay for padding steps;
    that cost is what continuous batching removes.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"hf_batch_size must be >= 1, got {batch_size}")
    with torch.inference_mode():  # warm-up, as for the engine
        first = torch.tensor([list(requests[0].prompt[:8])])
        hf_model.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=2, do_sample=False,
                          eos_token_id=None, pad_token_id=pad_token_id)
    started = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for batch_start in range(0, len(requests), batch_size):
            batch = requests[batch_start:batch_start + batch_size]
            width = max(request.prompt_len for request in batch)
            ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, request in enumerate(batch):
                ids[row, width - request.prompt_len:] = torch.tensor(request.prompt)
                mask[row, width - request.prompt_len:] = 1
            new_tokens = max(request.expected_output_len for request in batch)
            generated = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=pad_token_id)
            got = generated.shape[1] - width
            produced += sum(min(got, request.expected_output_len) for request in batch)
    elapsed = time.perf_counter() - started
    return BaselineResult(f"transformers generate (static batches of {batch_size})", elapsed, len(requests),
                          sum(request.prompt_len for request in requests), produced)


def run_generate_batch(hf_model, requests: list[SampleRequest], max_batch_tokens: int) -> BaselineResult:
    """transformers' continuous batching, one request per prompt with its own max_new_tokens, EOS disabled.

    Its paged cache is sized to hold every request at once (left to itself it sizes the cache from free
    memory, which on CPU means zero-filling gigabytes first) and its step budget is the engine's.
    """
    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        raise RuntimeError(f"transformers {transformers.__version__} has no ContinuousBatchingConfig; the generate_batch "
                           "baseline needs a newer one (5.17 and 5.24 are tested)")
    gen_config = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                               max_new_tokens=max(request.expected_output_len for request in requests))
    page_tokens = cache_page_tokens()
    num_blocks = sum(cdiv(request.prompt_len + request.expected_output_len, page_tokens)
                     for request in requests) + len(requests)
    cb_config = transformers.ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    manager = hf_model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        # The manager sizes its cache and warms up on the first request: keep that out of the timing.
        _wait_all(manager, {manager.add_request(list(requests[0].prompt[:8]), request_id="warmup", max_new_tokens=2,
                                                eos_token_id=-1): 2})
        started = time.perf_counter()
        ids = [manager.add_request(list(request.prompt), request_id=f"r{index}",
                                   max_new_tokens=request.expected_output_len, eos_token_id=-1)
               for index, request in enumerate(requests)]
        budgets = {request_id: request.expected_output_len for request_id, request in zip(ids, requests, strict=True)}
        produced = _wait_all(manager, budgets)
        elapsed = time.perf_counter() - started
    finally:
        manager.stop(block=True)
    return BaselineResult("transformers generate_batch (continuous batching)", elapsed, len(requests),
                          sum(request.prompt_len for request in requests), produced)


def cache_page_tokens() -> int:
    """Tokens per page of generate_batch's paged cache: the `page_size` field in newer transformers
    (5.24 has it, with `block_size` a deprecated alias that defaults to None), `block_size` in older
    ones (5.17)."""
    import transformers

    defaults = transformers.ContinuousBatchingConfig()
    page_size = getattr(defaults, "page_size", None)
    return page_size if page_size is not None else defaults.block_size  # type: ignore[return-value]  # one is set


# transformers 5.17 sizes a CPU cache by psutil's free-memory figure, which it takes as 0 without psutil.
_PSUTIL_HINT = " (psutil is not installed: older transformers need it to size generate_batch's cache on CPU)"


def _wait_all(manager, budget: dict[str, int]) -> int:
    """Block until every request id in budget has finished; returns the tokens produced within budget."""
    from transformers.utils import is_psutil_available

    produced, pending = 0, set(budget)
    while pending:
        # get_result(request_id=...) re-queues other requests' results; read them all as they come.
        result = manager.get_result(timeout=1.0)
        if result is None:
            if manager.background_thread_status.fatal_error is not None or not manager.is_running():
                raise RuntimeError(f"transformers generate_batch stopped with {len(pending)} requests pending")
            continue
        if result.error:
            raise RuntimeError(f"transformers generate_batch failed on {result.request_id}: {result.error}"
                               f"{_PSUTIL_HINT if not is_psutil_available() else ''}")
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            produced += min(len(result.generated_tokens), budget[result.request_id])
    return produced
