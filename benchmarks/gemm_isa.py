"""The packed GEMM's time per instruction set on the built-in model's shapes (SmolLM2-135M's Q4_1
projections, 30 layers of fused qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536],
and its Q8_0 head [49152, 576]), rows 1 to 32 (or --rows).

The instruction set is chosen once per process (STEPAHEAD_MAX_CPU_ISA), so each round runs one child
process per set, back to back, in the order given; random codes of the real sizes (the time does not
depend on their values), all 30 layers' weights distinct, as a decode step reads them. Per row count,
the median of --reps passes over the 120 projections, and of the head.

    .venv/bin/python benchmarks/gemm_isa.py --rounds 3 --isa avx512 avx2
    .venv/bin/python benchmarks/gemm_isa.py --rounds 3 --rows 32 64 256 --isa amx_int8 avx512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

LAYERS = 30
PROJECTIONS = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [N, K]
HEAD = (49152, 576)
ROWS = (1, 2, 4, 5, 8, 16, 32)


def _q4_tiles(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    from stepahead.kernels import cpu_packed

    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) / 16).half().float()
    mins = -(torch.rand(n, k // 32, generator=gen) / 2).half().float()
    return cpu_packed.tile_q4(q, scales, mins)


def _q8_tiles(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    from stepahead.kernels import cpu_packed

    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) / 64).half().float()
    return cpu_packed.tile_q8(q, scales)


def measure(reps: int, threads: int, row_counts: list[int]) -> dict:
    """In this process: per row count, the median milliseconds of the layers' projections and of the head."""
    from stepahead.kernels import cpu_packed

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    layers = [[(_q4_tiles(n, k, gen), n, k) for n, k in PROJECTIONS] for _ in range(LAYERS)]
    head = _q8_tiles(*HEAD, gen)
    out: dict = {"isa": cpu_packed.instruction_set(), "layers_ms": {}, "head_ms": {}}
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        layer_times, head_times = [], []
        for rep in range(reps + 1):  # the first pass warms up
            start = time.perf_counter()
            for layer in layers:
                for tiles, n, k in layer:
                    cpu_packed.packed_gemm(xs[k], tiles, n)
            middle = time.perf_counter()
            cpu_packed.packed_gemm(xs[576], head, HEAD[0])
            end = time.perf_counter()
            if rep:
                layer_times.append(middle - start)
                head_times.append(end - middle)
        out["layers_ms"][rows] = 1e3 * statistics.median(layer_times)
        out["head_ms"][rows] = 1e3 * statistics.median(head_times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", nargs="+", default=["avx512", "avx2"],
                        help="instruction sets, each run in its own process per round (amx_int8: no cap)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.reps, args.threads, args.rows)))
        return
    results: dict[str, list[dict]] = {isa: [] for isa in args.isa}
    for _ in range(args.rounds):
        for isa in args.isa:
            env = {k: v for k, v in os.environ.items() if k != "STEPAHEAD_MAX_CPU_ISA"}
            if isa != "amx_int8":  # the top set: no cap; "avx512" caps an AMX machine at the 512-bit tiles
                env["STEPAHEAD_MAX_CPU_ISA"] = isa
            child = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps),
                                    "--threads", str(args.threads), "--rows", *map(str, args.rows)],
                                   env=env, check=True, capture_output=True, text=True)
            result = json.loads(child.stdout.strip().splitlines()[-1])
            if result["isa"] != isa:
                raise SystemExit(f"asked for {isa}, the process multiplied with {result['isa']}")
            results[isa].append(result)
    print(f"medians over {args.rounds} rounds of each round's median of {args.reps} passes (ms); "
          f"per round in brackets")
    print("| rows | " + " | ".join(f"30 layers {isa} | head {isa}" for isa in args.isa) + " |")
    print("|---" * (1 + 2 * len(args.isa)) + "|")
    for rows in args.rows:
        cells = []
        for isa in args.isa:
            for key in ("layers_ms", "head_ms"):
                values = [r[key][str(rows)] for r in results[isa]]
                cells.append(f"{statistics.median(values):.3f} ({' / '.join(f'{v:.2f}' for v in values)})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
