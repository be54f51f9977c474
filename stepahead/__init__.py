"""stepahead: an LLM inference engine whose scheduler runs one step ahead of the model."""

from stepahead import mkl_env  # noqa: F401  (first: MKL reads it on its first call)
from stepahead.engine.arg_utils import EngineArgs
from stepahead.engine.llm import LLM
from stepahead.outputs import CompletionOutput, EngineStats, RequestOutput
from stepahead.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "EngineStats"]
