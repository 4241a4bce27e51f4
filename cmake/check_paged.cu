// Torch-free translation unit for the compile check (CMakeLists.txt, target compile_check):
// instantiates the paged-cache kernels (csrc/cuda/tree_attention_paged.cu,
// csrc/cuda/kv_cache_paged.cu launch them), so ptxas reports their registers and spills: the
// tensor-core tree attention for fp16 / bf16 x head dims 64, 128 (4 and 8 warps) and 256,
// the fallback kernel for fp32 / fp16 / bf16, and the paged compaction. Never linked.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "specdec/kv_cache.cuh"
#include "specdec/tree_attention.cuh"

namespace specdec {
namespace cuda {

#define SPECDEC_TREE_ATTN_MMA_PAGED(Elem)                                                               \
  template cudaError_t launch_tree_attention_mma<Elem, 64, 4, true>(const TreeAttentionParams&, cudaStream_t);  \
  template cudaError_t launch_tree_attention_mma<Elem, 64, 8, true>(const TreeAttentionParams&, cudaStream_t);  \
  template cudaError_t launch_tree_attention_mma<Elem, 128, 4, true>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma<Elem, 128, 8, true>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma<Elem, 256, 4, true>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma_dispatch<Elem, true>(const TreeAttentionParams&, int, cudaStream_t);

SPECDEC_TREE_ATTN_MMA_PAGED(__half)
SPECDEC_TREE_ATTN_MMA_PAGED(__nv_bfloat16)
#undef SPECDEC_TREE_ATTN_MMA_PAGED

template cudaError_t launch_tree_attention_simt<float, true>(const TreeAttentionParams&, cudaStream_t);
template cudaError_t launch_tree_attention_simt<__half, true>(const TreeAttentionParams&, cudaStream_t);
template cudaError_t launch_tree_attention_simt<__nv_bfloat16, true>(const TreeAttentionParams&, cudaStream_t);

template cudaError_t launch_compact_kv_cache_paged<kCompactMaxCaches, kCompactPathChunk>(
    const KvCacheView*, int64_t, const int32_t*, const int32_t*, const int32_t*, int64_t, int32_t, const int32_t*,
    int64_t, int64_t, int32_t, int32_t*, cudaStream_t);

}  // namespace cuda
}  // namespace specdec
