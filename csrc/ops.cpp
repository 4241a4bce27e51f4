// The specdec op library: every schema (and the NgramIndex and SuffixIndex classes), in one place, and the
// Python module that loads it.
//
// `import specdec_kernels._C` loads this shared library; its static initializers run the
// TORCH_LIBRARY block below and the TORCH_LIBRARY_IMPL blocks of the other csrc files
// (CPU kernels, and CUDA kernels when built), which is all the module is for. Python
// (specdec_kernels/_extension.py) adds fake implementations and reference kernels for the
// (op, device) pairs without a compiled one.
#include <Python.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ngram_index_class.h"
#include "suffix_index_class.h"

extern "C" {
// A module with no methods: registering the ops happens when the library loads.
PyObject* PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "_C",                                                   // name
      "specdec kernels; importing registers torch.ops.specdec",  // doc
      -1,                                                     // no per-interpreter state
      nullptr,                                                // no methods
  };
  return PyModule_Create(&module);
}
}

TORCH_LIBRARY(specdec, m) {
  m.def("tree_mask(Tensor parents) -> Tensor");
  m.def("pack_tree_mask(Tensor mask) -> Tensor");
  m.def(
      "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tree_mask, Tensor cache_seqlens, "
      "float scale, int window=0, float softcap=0.) -> Tensor");
  m.def(
      "verify(Tensor target_logits, Tensor tree_tokens, Tensor parents, Tensor? draft_probs, "
      "Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed) -> (Tensor, Tensor, Tensor)");
  m.def(
      "compact_kv_cache_(Tensor(a!)[] caches, Tensor cache_seqlens, Tensor accepted_nodes, "
      "Tensor num_accepted) -> Tensor");
  m.def(
      "ngram_propose(Tensor tokens, Tensor lengths, int min_n, int max_n, int num_tokens, str policy) "
      "-> (Tensor, Tensor)");
  m.def(
      "ngram_propose_tree(Tensor tokens, Tensor lengths, int min_n, int max_n, int num_tokens, "
      "int tree_width, int max_nodes, str policy) -> (Tensor, Tensor)");
  // The incremental n-gram index (a stateful object, CPU only): csrc/ngram_index.cpp.
  m.class_<specdec::NgramIndex>("NgramIndex")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("num_slots", &specdec::NgramIndex::num_slots)
      .def("max_n", &specdec::NgramIndex::max_n)
      .def("length", &specdec::NgramIndex::length)
      .def("memory_bytes", &specdec::NgramIndex::memory_bytes)
      .def("history", &specdec::NgramIndex::history)
      .def("reset", &specdec::NgramIndex::reset)
      .def("append", &specdec::NgramIndex::append)
      .def("propose", &specdec::NgramIndex::propose)
      .def("append_and_propose", &specdec::NgramIndex::append_and_propose);
  // The cross-sequence suffix cache (a stateful object, CPU only): csrc/suffix_index.cpp.
  m.class_<specdec::SuffixIndex>("SuffixIndex")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("num_slots", &specdec::SuffixIndex::num_slots)
      .def("reserve_slots", &specdec::SuffixIndex::reserve_slots)
      .def("cached", &specdec::SuffixIndex::cached)
      .def("appended", &specdec::SuffixIndex::appended)
      .def("memory_bytes", &specdec::SuffixIndex::memory_bytes)
      .def("length", &specdec::SuffixIndex::length)
      .def("clear", &specdec::SuffixIndex::clear)
      .def("add", &specdec::SuffixIndex::add)
      .def("start", &specdec::SuffixIndex::start)
      .def("fork", &specdec::SuffixIndex::fork)
      .def("append", &specdec::SuffixIndex::append)
      .def("draft", &specdec::SuffixIndex::draft)
      .def("append_and_draft", &specdec::SuffixIndex::append_and_draft);
  // Few-row linear products on the CPU (specdec_kernels/small_linear.py): y = x @ weight^T (+ bias), fp32; csrc/small_linear.cpp.
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Each row's greedy token of x @ weight^T (fp32 or bf16), exact, from an int8 copy of the weights and per-row bounds
  // (specdec_kernels/ops/small_linear.py); csrc/small_linear_argmax.cpp, csrc/include/specdec/small_linear_argmax.h.
  m.def("small_linear_argmax(Tensor x, Tensor weight, Tensor weight_int8, Tensor row_stats) -> Tensor");
  // RMSNorm over the last dim, weight covering x's trailing dims, on the CPU (specdec_kernels/ops/rms_norm.py); csrc/rms_norm.cpp.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // A Llama-family decoder layer's tree step on the CPU (specdec_kernels/ops/decoder_layer.py); csrc/decoder_layer.cpp.
  m.def(
      "decoder_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor?[] weights, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor tree_mask, Tensor cache_seqlens, float scale, float eps, int blas_rows=0) -> Tensor");
  // Paged KV caches: k/v (every cache) [num_pages, page_size, H, D], block_table int32 [B, P].
  m.def(
      "tree_attention_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tree_mask, Tensor cache_seqlens, "
      "Tensor block_table, float scale, int window=0, float softcap=0.) -> Tensor");
  m.def(
      "compact_kv_cache_paged_(Tensor(a!)[] caches, Tensor cache_seqlens, Tensor accepted_nodes, "
      "Tensor num_accepted, Tensor block_table) -> Tensor");
}
