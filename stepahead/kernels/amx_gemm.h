// The packed GEMM's AMX-INT8 path (amx_gemm.cpp): whole blocks of 16 rows on the CPU's tile unit, the
// same bits as the vector tiles of packed_gemm.cpp.
#pragma once

#include <cstdint>

#include "packed_gemm.h"
#include "warmer.h"

namespace stepahead_cpu {

constexpr int64_t kAmxRows = 16;  // rows of one AMX block (a tile's rows)
// The fewest rows of a panel that go to AMX: at 16 rows building the column block's tile layout costs
// what the tile unit saves over the 512-bit vector tiles (docs/BENCHMARKS.md, section 14.4).
constexpr int64_t kAmxMinRows = 32;

// Whether this process multiplies whole blocks of 16 rows with AMX-INT8: the CPU has AMX-TILE,
// AMX-INT8 and AVX-512 (F, BW), the kernel granted the process the tile state (asked once), and
// STEPAHEAD_MAX_CPU_ISA says none of avx2, avx512_vnni, avx512. Decided once per process.
bool use_amx();

// y[rows 0 .. M) x the columns of tiles t .. t + count (one or two tiles: a column block), M a multiple
// of kAmxRows; as packed_gemm.cpp's block of vector tiles, bit for bit.
using AmxBlockFn = void (*)(const PackedWeight& w, const QuantizedRows& xq, int64_t M, int64_t t, int64_t count,
                            const Output& out, Warmer* warmer);

// The AMX block for this format (every packed format has one), or nullptr where this process does
// not use AMX.
AmxBlockFn amx_block_runner(PackedWeight::Format format);

}  // namespace stepahead_cpu
