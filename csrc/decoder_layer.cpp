// A Llama-family decoder layer's tree step in one op, CPU only (specdec_kernels/ops/decoder_layer.py):
// what loop/hf/lean.py's LeanForward runs per layer, without the Python between its ~30 torch
// ops. On the default model (30 layers, 2 threads) that Python and the op calls around it were
// ~10 ms of a ~32 ms step (docs/loop.md, "Where a CPU decode step goes").
//
// The element-wise ops (include/specdec/decoder_layer.h) round where transformers' modules do;
// the SiLU is torch's own; the products are small_linear's kernel (the q/k/v products in one
// parallel region, gate/up in another), or torch's BLAS from `blas_rows` rows on; the
// attention is tree_attention's CPU kernel, through the dispatcher; the tree's keys and values
// are copied into the dense caches at cache_seqlens[b] + j. The result equals LeanForward's
// layer with every linear routed to small_linear up to the order of RMSNorm's sum of squares
// (python_tests/test_decoder_layer.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "small_linear_cpu.h"
#include "specdec/decoder_layer.h"

namespace specdec {
namespace {

constexpr const char* kOp = "decoder_layer";

// The layer's parameters, in the order of the op's `weights` list.
enum Weight {
  kInputNorm, kQ, kQBias, kK, kKBias, kV, kVBias, kQNorm, kKNorm, kO, kOBias, kPostNorm, kGate, kUp, kDown,
  kNumWeights
};
constexpr const char* kWeightNames[kNumWeights] = {
    "input_norm", "q_proj", "q_bias", "k_proj", "k_bias", "v_proj", "v_bias", "q_norm",
    "k_norm",     "o_proj", "o_bias", "post_norm", "gate_proj", "up_proj", "down_proj"};
constexpr bool kOptional[kNumWeights] = {false, false, true, false, true, false, true, true,
                                         true,  false, true, false, false, false, false};

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("specdec::tree_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, double, int64_t, double)>();
  return op.call(q, k_cache, v_cache, tree_mask, cache_seqlens, scale, 0, 0.0);
}

// y = x @ weight^T (+ bias) for each product: small_linear's kernel, or torch's BLAS (oneDNN /
// MKL: AMX tiles for bf16 where the CPU has them) for x of blas_rows rows or more (0: never),
// where the caller measured torch's faster (bf16 from ~8 rows on 2 Xeon cores: our VDPBF16PS
// kernel tops out near 100 GFLOP/s, and oneDNN ran 12 rows of the default model's MLP-up
// weights in 3.4 ms against its 5.9).
void products(const at::Tensor& x, c10::ArrayRef<LinearProduct> list, int64_t blas_rows) {
  if (blas_rows <= 0 || x.size(0) < blas_rows) {
    small_linear_many(x, list);
    return;
  }
  for (const LinearProduct& p : list) {
    at::Tensor y = p.y->view({x.size(0), p.weight->size(0)});
    if (p.bias != nullptr) {
      at::addmm_out(y, *p.bias, x, p.weight->t());
    } else {
      at::mm_out(y, x, p.weight->t());
    }
  }
}

// An element-wise step over `rows` independent rows of `row_elements` each: fn(r0, r1) for row
// ranges split over torch's threads when there are at least kParallelElements elements (a
// prefill chunk, whose norms, rotations, adds and gated products ran on one thread while the
// others waited: a bf16 batch-8 prefill of 1573 tokens on 2 threads 1.55-1.83 -> 1.47-1.67 s),
// else fn(0, rows) on the calling thread (a decode step's few rows: a parallel region would
// cost more than it saves). Rows are independent, so the results do not depend on the split.
constexpr int64_t kParallelElements = 32768;
template <typename Fn>
void over_rows(int64_t rows, int64_t row_elements, const Fn& fn) {
  if (rows * row_elements < kParallelElements || rows < 2) {
    fn(int64_t{0}, rows);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kParallelElements / 2 / std::max<int64_t>(row_elements, 1));
  at::parallel_for(0, rows, grain, fn);
}

// The layer, once checked. Storage is the kernels' element type, TorchScalar the torch type it
// matches bit for bit.
template <typename Storage, typename TorchScalar>
at::Tensor run_layer(const at::Tensor& hidden, const at::Tensor& cos_in, const at::Tensor& sin_in, const at::Tensor* w,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& tree_mask,
                     const at::Tensor& cache_seqlens, double scale, double eps_in, int64_t num_heads,
                     int64_t blas_rows) {
  auto data = [](const at::Tensor& t) { return reinterpret_cast<const Storage*>(t.const_data_ptr<TorchScalar>()); };
  auto mutable_data = [](at::Tensor& t) { return reinterpret_cast<Storage*>(t.mutable_data_ptr<TorchScalar>()); };
  const int64_t batch = hidden.size(0), num_nodes = hidden.size(1), width = hidden.size(2);
  const int64_t rows = batch * num_nodes, num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const float eps = static_cast<float>(eps_in);
  const at::TensorOptions options = hidden.options();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  auto bias = [&](Weight i) { return w[i].defined() ? &w[i] : nullptr; };

  // ---- attention: x = norm(hidden); q, k, v = x W^T; per-head norms; rotation; cache writes
  at::Tensor x = at::empty({rows, width}, options);
  const Storage* hidden_data = data(hidden);
  Storage* x_data = mutable_data(x);
  const Storage* input_norm = data(w[kInputNorm]);
  over_rows(rows, width, [&](int64_t r0, int64_t r1) {
    cpu::rms_norm_rows(hidden_data + r0 * width, width, input_norm, x_data + r0 * width, width, r1 - r0, width, eps);
  });
  at::Tensor q = at::empty({rows, q_width}, options);
  at::Tensor k = at::empty({rows, kv_width}, options);
  at::Tensor v = at::empty({rows, kv_width}, options);
  products(x, {{&w[kQ], bias(kQBias), &q}, {&w[kK], bias(kKBias), &k}, {&w[kV], bias(kVBias), &v}}, blas_rows);
  Storage* q_data = mutable_data(q);
  Storage* k_data = mutable_data(k);
  if (w[kQNorm].defined()) {
    const Storage* q_norm = data(w[kQNorm]);
    over_rows(rows * num_heads, head_dim, [&](int64_t r0, int64_t r1) {
      cpu::rms_norm_rows(q_data + r0 * head_dim, head_dim, q_norm, q_data + r0 * head_dim, head_dim, r1 - r0,
                         head_dim, eps);
    });
  }
  if (w[kKNorm].defined()) {
    const Storage* k_norm = data(w[kKNorm]);
    over_rows(rows * num_kv_heads, head_dim, [&](int64_t r0, int64_t r1) {
      cpu::rms_norm_rows(k_data + r0 * head_dim, head_dim, k_norm, k_data + r0 * head_dim, head_dim, r1 - r0,
                         head_dim, eps);
    });
  }
  const Storage* cos_data = data(cos);
  const Storage* sin_data = data(sin);
  over_rows(rows, q_width + kv_width, [&](int64_t r0, int64_t r1) {  // cos / sin: [rows, head_dim]
    cpu::rotate_rows(q_data + r0 * q_width, q_width, cos_data + r0 * head_dim, sin_data + r0 * head_dim, r1 - r0,
                     num_heads, head_dim);
    cpu::rotate_rows(k_data + r0 * kv_width, kv_width, cos_data + r0 * head_dim, sin_data + r0 * head_dim, r1 - r0,
                     num_kv_heads, head_dim);
  });
  // The tree's keys and values at slots cache_seqlens[b] + j of the [B, S, Hkv, D] caches.
  const int32_t* seqlens = cache_seqlens.const_data_ptr<int32_t>();
  const int64_t slot_bytes = kv_width * sizeof(Storage);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t slot = b * k_cache.size(1) + seqlens[b];
    std::memcpy(mutable_data(k_cache) + slot * kv_width, data(k) + b * num_nodes * kv_width, num_nodes * slot_bytes);
    std::memcpy(mutable_data(v_cache) + slot * kv_width, data(v) + b * num_nodes * kv_width, num_nodes * slot_bytes);
  }
  const at::Tensor attended = tree_attention(q.view({batch, num_nodes, num_heads, head_dim}), k_cache, v_cache,
                                             tree_mask, cache_seqlens, scale);
  at::Tensor h = at::empty({batch, num_nodes, width}, options);  // hidden + o_proj(attention)
  products(attended.reshape({rows, q_width}), {{&w[kO], bias(kOBias), &h}}, blas_rows);
  Storage* h_data = mutable_data(h);
  over_rows(rows, width, [&](int64_t r0, int64_t r1) {
    cpu::add_elements(hidden_data + r0 * width, h_data + r0 * width, h_data + r0 * width, (r1 - r0) * width);
  });

  // ---- MLP: h + down(silu(gate(y)) * up(y)), y = norm(h)
  const Storage* post_norm = data(w[kPostNorm]);
  over_rows(rows, width, [&](int64_t r0, int64_t r1) {
    cpu::rms_norm_rows(h_data + r0 * width, width, post_norm, x_data + r0 * width, width, r1 - r0, width, eps);
  });
  const int64_t inner = w[kGate].size(0);
  at::Tensor gate = at::empty({rows, inner}, options);
  at::Tensor up = at::empty({rows, inner}, options);
  products(x, {{&w[kGate], nullptr, &gate}, {&w[kUp], nullptr, &up}}, blas_rows);
  at::silu_(gate);  // torch's own (vectorised exp), as the model's act_fn
  Storage* gate_data = mutable_data(gate);
  const Storage* up_data = data(up);
  over_rows(rows, inner, [&](int64_t r0, int64_t r1) {
    cpu::mul_elements(gate_data + r0 * inner, up_data + r0 * inner, gate_data + r0 * inner, (r1 - r0) * inner);
  });
  at::Tensor out = at::empty({batch, num_nodes, width}, options);
  products(gate, {{&w[kDown], nullptr, &out}}, blas_rows);
  Storage* out_data = mutable_data(out);
  over_rows(rows, width, [&](int64_t r0, int64_t r1) {
    cpu::add_elements(h_data + r0 * width, out_data + r0 * width, out_data + r0 * width, (r1 - r0) * width);
  });
  return out;
}

at::Tensor decoder_layer_cpu(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                             c10::List<std::optional<at::Tensor>> weights, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, double scale, double eps,
                             int64_t blas_rows) {
  // ---- checks (metadata only)
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous(), kOp, ": hidden must be a contiguous [B, T, hidden] tensor, got shape ",
              hidden.sizes(), " strides ", hidden.strides());
  TORCH_CHECK(hidden.device().is_cpu(), kOp, ": CPU only, got hidden on ", hidden.device());
  const at::ScalarType dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, kOp, ": hidden must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kNumWeights, kOp, ": weights must list ", kNumWeights,
              " entries (input_norm, q_proj, q_bias, k_proj, k_bias, v_proj, v_bias, q_norm, k_norm, o_proj, o_bias, "
              "post_norm, gate_proj, up_proj, down_proj), got ", weights.size());
  at::Tensor w[kNumWeights];
  for (int i = 0; i < kNumWeights; ++i) {
    const std::optional<at::Tensor> entry = weights.get(i);
    if (entry.has_value() && entry->defined()) {
      w[i] = *entry;
      TORCH_CHECK(w[i].device().is_cpu() && w[i].scalar_type() == dtype && w[i].is_contiguous(), kOp, ": ",
                  kWeightNames[i], " must be a contiguous CPU tensor of hidden's dtype ", dtype, ", got ",
                  w[i].scalar_type(), " on ", w[i].device());
    } else {
      TORCH_CHECK(kOptional[i], kOp, ": ", kWeightNames[i], " is required");
    }
  }
  const int64_t batch = hidden.size(0), num_nodes = hidden.size(1), width = hidden.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              kOp, ": k_cache and v_cache must be contiguous dense caches [B, S, Hkv, D] of one shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  // The tree's keys and values are copied into the caches as hidden's element type, and cos /
  // sin read as it: all of one dtype, on the CPU.
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache}, {"v_cache", &v_cache},
                                {"cos", &cos}, {"sin", &sin}}) {
    TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(), kOp, ": ", name,
                " must be a CPU tensor of hidden's dtype ", dtype, ", got ", t->scalar_type(), " on ", t->device());
  }
  check_tensor(kOp, "cache_seqlens", cache_seqlens, 1, at::kInt);
  check_device(kOp, "cache_seqlens", cache_seqlens, hidden.device());
  check_size(kOp, "k_cache", k_cache, 0, batch, "B (hidden.size(0))");
  check_size(kOp, "cache_seqlens", cache_seqlens, 0, batch, "B (hidden.size(0))");
  const int64_t num_kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(w[kQ].dim() == 2 && w[kQ].size(1) == width && w[kQ].size(0) % head_dim == 0, kOp,
              ": q_proj must be [Hq * D, hidden] with the cache's D = ", head_dim, ", got ", w[kQ].sizes());
  const int64_t num_heads = w[kQ].size(0) / head_dim;
  for (const Weight i : {kK, kV}) {
    TORCH_CHECK(w[i].dim() == 2 && w[i].size(0) == num_kv_heads * head_dim && w[i].size(1) == width, kOp, ": ",
                kWeightNames[i], " must be [Hkv * D, hidden] = [", num_kv_heads * head_dim, ", ", width, "], got ",
                w[i].sizes());
  }
  TORCH_CHECK(w[kO].dim() == 2 && w[kO].size(1) == num_heads * head_dim, kOp, ": o_proj must be [hidden, Hq * D], got ",
              w[kO].sizes());
  for (const Weight i : {kQBias, kKBias, kVBias, kOBias}) {
    const Weight product = static_cast<Weight>(i - 1);  // each bias follows its projection
    TORCH_CHECK(!w[i].defined() || (w[i].dim() == 1 && w[i].size(0) == w[product].size(0)), kOp, ": ",
                kWeightNames[i], " must be [", w[product].size(0), "] (", kWeightNames[product], "'s N), got ",
                w[i].sizes());
  }
  TORCH_CHECK(w[kO].size(0) == width && w[kGate].dim() == 2 && w[kGate].size(1) == width &&
                  w[kUp].sizes() == w[kGate].sizes() && w[kDown].dim() == 2 && w[kDown].size(0) == width &&
                  w[kDown].size(1) == w[kGate].size(0),
              kOp, ": o_proj, gate_proj, up_proj, down_proj must be [hidden, Hq * D], [I, hidden], [I, hidden], "
              "[hidden, I], got ", w[kO].sizes(), ", ", w[kGate].sizes(), ", ", w[kUp].sizes(), ", ", w[kDown].sizes());
  for (const Weight i : {kInputNorm, kPostNorm}) {
    TORCH_CHECK(w[i].dim() == 1 && w[i].size(0) == width, kOp, ": ", kWeightNames[i], " must be [hidden] = [", width,
                "], got ", w[i].sizes());
  }
  for (const Weight i : {kQNorm, kKNorm}) {
    TORCH_CHECK(!w[i].defined() || (w[i].dim() == 1 && w[i].size(0) == head_dim), kOp, ": ", kWeightNames[i],
                " must be [D] = [", head_dim, "], got ", w[i].sizes());
  }
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == batch && cos.size(1) == num_nodes &&
                  cos.size(2) == head_dim,
              kOp, ": cos and sin must be [B, T, D] = [", batch, ", ", num_nodes, ", ", head_dim, "], got ", cos.sizes(),
              " and ", sin.sizes());
  const int32_t* seqlens = cache_seqlens.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(seqlens[b] >= 0 && seqlens[b] + num_nodes <= k_cache.size(1), kOp, ": cache_seqlens[", b, "] = ",
                seqlens[b], "; the prefix + T=", num_nodes, " tree entries must fit in the cache (S=",
                k_cache.size(1), ")");
  }

  if (dtype == at::kFloat) return run_layer<float, float>(hidden, cos, sin, w, k_cache, v_cache, tree_mask,
                                                           cache_seqlens, scale, eps, num_heads, blas_rows);
  return run_layer<cpu::BFloat16Bits, at::BFloat16>(hidden, cos, sin, w, k_cache, v_cache, tree_mask, cache_seqlens,
                                                     scale, eps, num_heads, blas_rows);
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("decoder_layer", &specdec::decoder_layer_cpu); }
