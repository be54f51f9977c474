"""The server's periodic engine line: vLLM's figures, and a GPU figure only where there is a device time."""

from __future__ import annotations

import asyncio
import logging

import pytest

from stepahead.entrypoints.openai.metrics import log_stats_periodically
from stepahead.outputs import EngineStats


def _logged_line(device: str, caplog) -> str:
    later = EngineStats(device=device, generation_tokens=50, busy_s=0.9, gpu_busy_s=0.4, wall_s=1.0, num_running=1)
    snapshots = [EngineStats(device=device)]  # the first call's; every later call gets `later`

    async def two_intervals() -> None:
        task = asyncio.create_task(log_stats_periodically(lambda: snapshots.pop() if snapshots else later,
                                                          interval_s=0.01))
        while not caplog.records:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="stepahead.entrypoints.openai"):
        asyncio.run(two_intervals())
    return caplog.records[0].getMessage()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gpu_utilization_is_logged_only_with_a_device_time(device, caplog):
    line = _logged_line(device, caplog)
    assert "Running: 1 reqs" in line and "Host utilization: 90.0%" in line
    if device == "cpu":
        assert "GPU" not in line
    else:
        assert line.endswith("GPU utilization: 40.0%")
