"""The packed GEMM at the built-in model's shapes, in this process's instruction set (cpu_packed.instruction_set;
STEPAHEAD_MAX_CPU_ISA=avx512_vnni caps it below AMX): median microseconds per call, one line of JSON.
The choice is made once per process, so an A/B alternates processes:

    for i in 1 2 3; do for isa in amx_int8 avx512_vnni; do
      STEPAHEAD_MAX_CPU_ISA=$isa python benchmarks/amx_gemm.py --threads 1; done; done

--weights N calls N distinct weights of each shape in turn (a model's layers: the weights come from
memory, not the cache) and reports the mean per call; --cpu-time times calls by the process's CPU time
instead of the wall clock, so that time spent off the core on a shared machine does not count (with
one thread, the call's own time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stepahead.kernels import cpu_packed
from stepahead.models.quant.quant_weights import quantize_int4

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads of 64 over 3 KV heads, vocabulary 49152.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--weights", type=int, default=1, help="distinct weights per shape, called in turn")
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU time, not the wall clock")
    args = parser.parse_args()
    if args.weights < 1:
        parser.error(f"--weights must be at least 1, got {args.weights}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict[str, object] = {"isa": cpu_packed.instruction_set(), "threads": args.threads}
    for name in args.shapes:
        n, k = SHAPES[name]
        weights = [quantize_int4(torch.randn(n, k)) for _ in range(args.weights)]
        tiles = [cpu_packed.tile_q4(weight.q, weight.scales, weight.mins) for weight in weights]
        for rows in args.rows:
            if name == "head" and rows > 64:
                continue  # a prefill computes the head for its last tokens only
            x = torch.randn(rows, k)
            for t in tiles:
                cpu_packed.packed_gemm(x, t, n)  # warm: the pages touched, the threads started
            times = []
            for _ in range(args.repeats):
                start = clock()
                for t in tiles:
                    cpu_packed.packed_gemm(x, t, n)
                times.append((clock() - start) / len(tiles))
            result[f"{name}@{rows}"] = round(statistics.median(times) * 1e6, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
