"""Pipeline stages of unequal size: vLLM's split when P does not divide the layers, and the
STEPAHEAD_PP_LAYER_PARTITION override, validated with errors that name the numbers."""

from __future__ import annotations

import pytest

from stepahead.distributed.layer_partition import (
    PARTITION_ENV,
    layer_partition,
    parse_layer_partition,
    partition_from_env,
    stage_layer_range,
)
from stepahead.distributed.state import ParallelState
from stepahead.engine.arg_utils import EngineArgs
from stepahead.models.llama_args import stage_layers
from tests.distributed.conftest import MAX_MODEL_LEN


@pytest.mark.parametrize("num_layers,pp_size,counts", [
    (2, 1, (2,)), (4, 2, (2, 2)), (2, 2, (1, 1)),
    (3, 2, (2, 1)),  # the remainder goes to the stages before the last, second-to-last first
    (3, 3, (1, 1, 1)), (4, 3, (1, 2, 1)), (5, 3, (2, 2, 1)),
    (22, 4, (5, 6, 6, 5)), (23, 4, (6, 6, 6, 5)), (7, 5, (1, 1, 2, 2, 1)),
])
def test_default_split(num_layers, pp_size, counts):
    assert layer_partition(num_layers, pp_size) == counts
    ranges = [stage_layer_range(num_layers, k, pp_size) for k in range(pp_size)]
    assert [len(r) for r in ranges] == list(counts)
    assert [i for r in ranges for i in r] == list(range(num_layers))  # contiguous, in order, each once


def test_stage_layers_follows_the_parallel_state():
    assert [stage_layers(3, ParallelState(pp_size=2, pp_rank=k)) for k in (0, 1)] == [range(0, 2), range(2, 3)]
    assert [stage_layers(3, ParallelState(pp_size=2, pp_rank=k, layer_partition=(1, 2))) for k in (0, 1)] == \
        [range(0, 1), range(1, 3)]


def test_override():
    assert layer_partition(20, 4, parse_layer_partition("4,6,6,4")) == (4, 6, 6, 4)
    assert [stage_layer_range(22, k, 4, (5, 6, 5, 6)) for k in range(4)] == \
        [range(0, 5), range(5, 11), range(11, 16), range(16, 22)]


@pytest.mark.parametrize("text,num_layers,pp_size,message", [
    ("5,5,5,5,", 20, 4, "must be comma-separated layer counts"),
    ("5,5,5,a", 20, 4, "must be comma-separated layer counts"),
    ("5,5,5", 20, 4, r"gives 3 layer counts \[5, 5, 5\], but pipeline_parallel_size=4"),
    ("5,5,5,5", 21, 4, r"sum to 20, but the model has num_hidden_layers=21"),
    ("0,3", 3, 2, "every stage needs at least one layer"),
])
def test_bad_override(text, num_layers, pp_size, message):
    with pytest.raises(ValueError, match=f"{PARTITION_ENV}.*{message}"):
        layer_partition(num_layers, pp_size, parse_layer_partition(text))


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds num_hidden_layers=2"):
        layer_partition(2, 3)


def test_env_reaches_the_engine_config(tiny_llama, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert partition_from_env() is None
    monkeypatch.setenv(PARTITION_ENV, "2")
    config = EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN).create_engine_config()
    assert config.parallel_config.pp_layer_partition == (2,)
    monkeypatch.setenv(PARTITION_ENV, "1,2")  # the tiny Llama has 2 layers
    with pytest.raises(ValueError, match=r"sum to 3, but the model has num_hidden_layers=2"):
        EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, pipeline_parallel_size=2).create_engine_config()
