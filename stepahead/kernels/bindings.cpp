// The kernels as a plain Python extension module. A pybind11 call costs about a microsecond; the same
// kernel registered as a torch operator and called through torch.ops cost ten or more (argument
// parsing against the schema, boxing, the dispatcher), which a one-token step pays on every one of
// its hundreds of calls. Each call releases the GIL while it computes, as torch's operators do.

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_stack.h"
#include "ops.h"
#include "suffix_trie.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("packed_gemm", &stepahead_cpu::packed_gemm, no_gil);
  m.def("packed_gemm_isa", &stepahead_cpu::packed_gemm_isa);
  m.def("rms_norm", &stepahead_cpu::rms_norm, no_gil);
  m.def("silu_mul", &stepahead_cpu::silu_mul, no_gil);
  m.def("round_to_bf16_", &stepahead_cpu::round_to_bf16_, no_gil);
  m.def("rotary_embedding", &stepahead_cpu::rotary_embedding, no_gil);
  m.def("paged_decode_attention", &stepahead_cpu::paged_decode_attention, no_gil);
  m.def("paged_decode_isa", &stepahead_cpu::paged_decode_isa);
  m.def("write_kv_rows", &stepahead_cpu::write_kv_rows, no_gil);
  py::class_<stepahead_cpu::DecodeStack>(m, "DecodeStack")
      .def(py::init<const std::vector<std::vector<at::Tensor>>&, const std::vector<std::vector<int64_t>>&, int64_t,
                    int64_t, int64_t, double, double, bool>())
      .def("forward", &stepahead_cpu::DecodeStack::forward, no_gil);
  // The trie keeps the GIL: its calls are short, and the GIL is what keeps two threads off one trie.
  using stepahead_cpu::SuffixTrie;
  py::class_<SuffixTrie>(m, "SuffixTrie")
      .def(py::init<int64_t>())
      .def("extend", &SuffixTrie::extend)
      .def("retract", &SuffixTrie::retract)
      .def("match", &SuffixTrie::match)
      .def("match_tokens", &SuffixTrie::match_tokens)
      .def("draft", &SuffixTrie::draft)
      .def("count", &SuffixTrie::count)
      .def("substring_counts", &SuffixTrie::substring_counts)
      .def("memory_bytes", &SuffixTrie::memory_bytes)
      .def_property_readonly("num_nodes", &SuffixTrie::num_nodes)
      .def_property_readonly("max_depth", &SuffixTrie::max_depth);
}
