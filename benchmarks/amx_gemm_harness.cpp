// The AMX block of kernels/amx_gemm.cpp alone, without the extension (no torch build, seconds to
// compile): random 4/5/8-bit records and activation codes, the block called per work item as
// packed_gemm.cpp's multiply calls it (column blocks over panels of rows), distinct weights in turn.
// Prints the fastest and the median of the passes, per call: with one thread the thread's
// CPU time (time off the core on a shared machine does not count), with more the wall clock. Given a
// file, writes the outputs there, to compare two versions' bits with cmp. Built against any version of
// amx_gemm.cpp (AMX_SRC), so that a before / after pair runs in alternated processes:
//
//   git show BASE:stepahead/kernels/amx_gemm.cpp > /tmp/amx_before.cpp  # BASE: the version to compare
//   I=$(python -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
//   F="-O3 -std=c++20 -w -mavx2 -mfma -mf16c -ffp-contract=off -Istepahead/kernels"
//   for v in before:/tmp/amx_before.cpp after:$PWD/stepahead/kernels/amx_gemm.cpp; do
//     g++ $F $I -DAMX_SRC="\"${v#*:}\"" benchmarks/amx_gemm_harness.cpp -o /tmp/amx_${v%%:*} -lpthread; done
//   for i in 1 2 3 4 5; do for v in before after; do /tmp/amx_$v 0 256 3072 576 1 7 8; done; done
//
// Arguments: format (PackedWeight::Format: 0 Q4, 1 Q8, 2 Q5, 3 Q4_K, 4 Q5_K, 5 Q6_K), rows M, N, K,
// threads, passes, weights, and optionally the output file (the last weight's outputs).
#include AMX_SRC

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <span>
#include <thread>
#include <vector>

using stepahead_cpu::PackedWeight;

namespace {

// Seconds on the clock that the thread count asks for (see the top of the file).
double seconds(int threads) {
  timespec now{};
  clock_gettime(threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// Random records whose float16 fields (scales, mins, k-quant d and -dmin) are small finite values.
std::vector<uint8_t> random_tiles(PackedWeight::Format format, int64_t N, int64_t K, std::mt19937& rng) {
  using namespace stepahead_cpu;
  const int64_t records = (N + kTileColumns - 1) / kTileColumns * (K / record_inputs(format));
  const int64_t bytes = record_bytes(format);
  std::vector<uint8_t> tiles(records * bytes);
  for (uint8_t& b : tiles) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> magnitude(0.001f, 0.05f);
  for (int64_t r = 0; r < records; ++r) {
    uint8_t* record = tiles.data() + r * bytes;
    const bool kquant = is_kquant(format);
    auto* halves = reinterpret_cast<uint16_t*>(kquant ? record : record + code_bytes(format));
    const int count = format == PackedWeight::Format::kQ8 || format == PackedWeight::Format::kQ6K ? 8 : 16;
    for (int i = 0; i < count; ++i) halves[i] = _cvtss_sh(i < 8 ? magnitude(rng) : -magnitude(rng), 0);
  }
  return tiles;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace stepahead_cpu;
  if (argc < 8) {
    std::fprintf(stderr, "usage: %s format rows N K threads passes weights [outputs]\n", argv[0]);
    return 2;
  }
  const auto format = static_cast<PackedWeight::Format>(std::atoi(argv[1]));
  const int64_t M = std::atoll(argv[2]), N = std::atoll(argv[3]), K = std::atoll(argv[4]);
  const int threads = std::atoi(argv[5]), passes = std::atoi(argv[6]), weight_count = std::atoi(argv[7]);
  const AmxBlockFn block = amx_block_runner(format);
  if (block == nullptr) {
    std::fprintf(stderr, "this process does not use AMX\n");
    return 1;
  }
  std::mt19937 rng(1234);
  std::vector<std::vector<uint8_t>> weights;
  for (int i = 0; i < weight_count; ++i) weights.push_back(random_tiles(format, N, K, rng));
  // The codes 64-byte aligned, as torch allocates them: each tile row one cache line.
  const std::unique_ptr<int16_t, decltype(&std::free)> aligned(
      static_cast<int16_t*>(std::aligned_alloc(64, (M * K * sizeof(int16_t) + 63) / 64 * 64)), &std::free);
  const std::span<int16_t> codes(aligned.get(), M * K);
  std::vector<float> scales(M * K / kGroup), sums(M * K / kGroup), y(M * N);
  for (int16_t& c : codes) c = static_cast<int16_t>(static_cast<int>(rng() % 65535) - 32767);
  std::uniform_real_distribution<float> scale(0.001f, 0.05f);
  for (float& s : scales) s = scale(rng);
  for (float& s : sums) s = 100 * scale(rng);
  // Work items as packed_gemm.cpp's multiply: panels of rows whose codes fit 256 KB, whole AMX blocks.
  const int64_t tiles = (N + kTileColumns - 1) / kTileColumns, blocks = (tiles + 1) / 2;
  const int64_t panel = std::max<int64_t>(kAmxRows, 256 * 1024 / (2 * K) / 4 * 4 / kAmxRows * kAmxRows);
  const int64_t items = (M + panel - 1) / panel * blocks;
  const auto run = [&](const std::vector<uint8_t>& tiles_of, int member) {
    const PackedWeight w{format, tiles_of.data(), nullptr, N, K};
    for (int64_t item = member; item < items; item += threads) {
      const int64_t first = item / blocks * panel, t = item % blocks * 2;
      const int64_t rows = std::min(panel, M - first) / kAmxRows * kAmxRows;
      const QuantizedRows x{codes.data() + first * K, scales.data() + first * K / kGroup,
                            sums.data() + first * K / kGroup, K};
      const Output out{y.data() + first * N, false, N};
      if (rows > 0) block(w, x, rows, t, std::min<int64_t>(2, tiles - t), out, nullptr);
    }
  };
  std::vector<double> per_call;
  for (int pass = 0; pass < passes; ++pass) {
    const double start = seconds(threads);
    for (const auto& w : weights) {
      if (threads == 1) {
        run(w, 0);
        continue;
      }
      std::vector<std::thread> team;
      for (int member = 0; member < threads; ++member) team.emplace_back(run, std::cref(w), member);
      for (std::thread& member : team) member.join();
    }
    per_call.push_back((seconds(threads) - start) / weight_count);
  }
  std::sort(per_call.begin(), per_call.end());
  const double macs = static_cast<double>(M / kAmxRows * kAmxRows) * N * K;
  std::printf("format=%d M=%ld N=%ld K=%ld threads=%d fastest_us=%.1f median_us=%.1f GMAC/s=%.1f\n",
              static_cast<int>(format), static_cast<long>(M), static_cast<long>(N), static_cast<long>(K), threads,
              per_call.front() * 1e6, per_call[per_call.size() / 2] * 1e6, macs / per_call.front() / 1e9);
  if (argc > 8) {
    FILE* f = std::fopen(argv[8], "wb");
    if (f == nullptr || std::fwrite(y.data(), sizeof(float), y.size(), f) != y.size()) return 1;
    std::fclose(f);
  }
  return 0;
}
