// CUDA glue for tree_attention: checks, bool-mask packing, the split-KV workspace, current
// stream; the kernels are in include/specdec/tree_attention.cuh. No host sync: the number of
// KV splits comes from shapes (S, not cache_seqlens), and every buffer is allocated with the
// caching allocator, so the op captures into CUDA graphs.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "tree_attention_checks.h"
#include "specdec/tree.cuh"
#include "specdec/tree_attention.cuh"

namespace specdec {
namespace {

constexpr const char* kOp = "tree_attention";

// Whether every row the tensor-core kernel copies with 16-byte cp.async is 16-byte aligned:
// the base address and each outer stride (in 2-byte elements) a multiple of 16 bytes.
bool rows_aligned(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  for (int64_t dim = 0; dim < 3; ++dim) {
    if (t.size(dim) > 1 && (t.stride(dim) * t.element_size()) % 16 != 0) return false;
  }
  return true;
}

template <typename Elem>
cudaError_t launch(const cuda::TreeAttentionParams& params, bool use_mma, int warps, cudaStream_t stream) {
  if constexpr (std::is_same_v<Elem, float>) {
    return cuda::launch_tree_attention_simt<float>(params, stream);
  } else {
    return use_mma ? cuda::launch_tree_attention_mma_dispatch<Elem>(params, warps, stream)
                   : cuda::launch_tree_attention_simt<Elem>(params, stream);
  }
}

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& tree_mask, const at::Tensor& cache_seqlens, double scale,
                               int64_t window, double softcap) {
  TORCH_CHECK(q.is_cuda(), kOp, ": q must be a CUDA tensor, got ", q.device());
  const at::Device device = q.device();
  const at::Tensor mask = check_tree_attention_args(q, k_cache, v_cache, tree_mask, cache_seqlens, device);
  const at::ScalarType dtype = q.scalar_type();
  const bool packed_input = mask.scalar_type() == at::kLong;
  const int64_t batch = q.size(0);
  const int64_t num_nodes = q.size(1);
  const int64_t num_q_heads = q.size(2);
  const int64_t head_dim = q.size(3);
  const int64_t value_dim = v_cache.size(3);
  check_window_softcap(kOp, window, softcap);
  const int64_t cache_len = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t words = (num_nodes + 63) / 64;
  // This kernel's limits.
  TORCH_CHECK(num_nodes >= 1, kOp, ": q must hold T >= 1 tree nodes, got shape ", q.sizes());
  TORCH_CHECK(cache_len >= num_nodes, kOp, ": k_cache must hold the T = ", num_nodes, " tree entries, got S = ",
              cache_len);
  TORCH_CHECK(head_dim >= 1 && head_dim <= cuda::kTreeAttnMaxHeadDim, kOp, ": q: the CUDA kernel supports head dims 1 .. ",
              cuda::kTreeAttnMaxHeadDim, ", got ", head_dim);
  TORCH_CHECK(value_dim >= 1 && value_dim <= cuda::kTreeAttnMaxHeadDim, kOp,
              ": v_cache: the CUDA kernel supports value head dims 1 .. ", cuda::kTreeAttnMaxHeadDim, ", got ", value_dim);
  check_fits_int32(kOp, "S (k_cache.size(1))", cache_len);
  check_fits_int32(kOp, "T * Hq (q.size(1) * q.size(2))", num_nodes * num_q_heads);
  TORCH_CHECK(batch <= 65535 && num_kv_heads <= 65535, kOp, ": batch size (", batch, ") and KV heads (",
              num_kv_heads, ") must be at most 65535 (grid dimensions)");

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = q.new_empty({batch, num_nodes, num_q_heads, value_dim});  // contiguous
  if (out.numel() == 0) return out;  // B, T or Hq of 0: nothing to launch (a 0-block grid is an error)
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Packed ancestor words: as given, or packed on the device from the bool mask (once when
  // every row shares it, as after expand, and read with batch stride 0).
  at::Tensor packed = mask;
  int64_t mask_stride_b = mask.size(0) == 1 ? 0 : mask.stride(0);
  if (!packed_input) {
    const bool shared = mask.size(0) == 1 || mask.stride(0) == 0;
    const at::Tensor src = shared ? mask.narrow(0, 0, 1) : mask;
    packed = mask.new_empty({src.size(0), num_nodes, words}, mask.options().dtype(at::kLong));
    // bool is read as its byte, so the kernel never loads a bool that is not 0 or 1.
    C10_CUDA_CHECK(cuda::launch_pack_tree_mask(reinterpret_cast<const uint8_t*>(src.const_data_ptr<bool>()),
                                               src.stride(0), src.stride(1), src.stride(2), src.size(0), num_nodes,
                                               num_nodes, packed.mutable_data_ptr<int64_t>(), stream));
    mask_stride_b = shared ? 0 : packed.stride(0);
  }
  const at::Tensor seqlens = cache_seqlens.contiguous();

  cuda::TreeAttentionParams params{};
  params.q = q.const_data_ptr();
  params.k = k_cache.const_data_ptr();
  params.v = v_cache.const_data_ptr();
  params.mask = packed.const_data_ptr<int64_t>();
  params.seqlens = seqlens.const_data_ptr<int32_t>();
  params.out = out.mutable_data_ptr();
  params.q_stride_b = q.stride(0);
  params.q_stride_t = q.stride(1);
  params.q_stride_h = q.stride(2);
  params.k_stride_b = k_cache.stride(0);
  params.k_stride_s = k_cache.stride(1);
  params.k_stride_h = k_cache.stride(2);
  params.v_stride_b = v_cache.stride(0);
  params.v_stride_s = v_cache.stride(1);
  params.v_stride_h = v_cache.stride(2);
  params.mask_stride_b = mask_stride_b;
  params.mask_stride_t = packed.stride(1);
  params.mask_stride_w = packed.stride(2);
  params.out_stride_b = out.stride(0);
  params.out_stride_t = out.stride(1);
  params.out_stride_h = out.stride(2);
  params.batch = static_cast<int32_t>(batch);
  params.num_nodes = static_cast<int32_t>(num_nodes);
  params.num_q_heads = static_cast<int32_t>(num_q_heads);
  params.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  params.head_dim = static_cast<int32_t>(head_dim);
  params.value_dim = static_cast<int32_t>(value_dim);
  params.window = static_cast<int32_t>(std::min<int64_t>(window, INT32_MAX));
  params.softcap = static_cast<float>(softcap);
  params.scale = static_cast<float>(scale);
  params.group = static_cast<int32_t>(num_q_heads / num_kv_heads);
  params.cache_len = static_cast<int32_t>(cache_len);
  params.num_splits = 1;
  params.num_m_tiles = 1;
  params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e): the kernels use exp2

  // Tensor cores for 16-bit inputs with D in {64, 128, 256} and 16-byte aligned rows on
  // sm_80+; everything else takes the (slow, exact-fp32-math) fallback kernel.
  // Device attributes are host-side queries (no sync, fine during graph capture).
  int cc_major = 0, num_sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device.index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device.index()));
  // Dv != D (MLA) runs the fallback kernel: the tensor-core tiles hold K and V of one width.
  const bool use_mma = dtype != at::kFloat && cuda::tree_attention_mma_head_dim(static_cast<int>(head_dim)) &&
                       value_dim == head_dim &&
                       cc_major >= 8 && rows_aligned(q) && rows_aligned(k_cache) && rows_aligned(v_cache);
  int warps = 4;
  at::Tensor workspace;
  if (use_mma) {
    const int64_t rows = num_nodes * params.group;
    warps = cuda::tree_attention_mma_warps(static_cast<int>(head_dim), rows);
    const int64_t m_tiles = (rows + 16 * warps - 1) / (16 * warps);
    const int splits =
        cuda::tree_attention_num_splits(batch, num_kv_heads, m_tiles, rows, cache_len, num_sms);
    params.num_m_tiles = static_cast<int32_t>(m_tiles);
    params.num_splits = splits;
    if (splits > 1) {
      // part_o [B, Hkv, splits, rows, D] then part_lse [B, Hkv, splits, rows], fp32.
      const int64_t parts = batch * num_kv_heads * splits * rows;
      workspace = q.new_empty({parts * (head_dim + 1)}, q.options().dtype(at::kFloat));
      params.part_o = workspace.mutable_data_ptr<float>();
      params.part_lse = params.part_o + parts * head_dim;
    }
  }

  cudaError_t err;
  if (dtype == at::kHalf) {
    err = launch<__half>(params, use_mma, warps, stream);
  } else if (dtype == at::kBFloat16) {
    err = launch<__nv_bfloat16>(params, use_mma, warps, stream);
  } else {
    err = launch<float>(params, use_mma, warps, stream);
  }
  C10_CUDA_CHECK(err);
  return out;
}

}  // namespace
}  // namespace specdec

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("tree_attention", &specdec::tree_attention_cuda); }
