// Torch-free translation unit for the compile check (CMakeLists.txt, target compile_check):
// explicitly instantiates every tree_attention kernel the torch glue (csrc/cuda/tree_attention.cu)
// can launch, so ptxas reports registers and spills for each: the tensor-core kernel for
// fp16 / bf16 x head dims 64, 128 (4 and 8 warps) and 256 (4 warps), the split combine, and
// the fallback kernel for fp32 / fp16 / bf16. Never linked into the extension.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "specdec/tree_attention.cuh"

namespace specdec {
namespace cuda {

#define SPECDEC_TREE_ATTN_MMA(Elem)                                                              \
  template cudaError_t launch_tree_attention_mma<Elem, 64, 4>(const TreeAttentionParams&, cudaStream_t);  \
  template cudaError_t launch_tree_attention_mma<Elem, 64, 8>(const TreeAttentionParams&, cudaStream_t);  \
  template cudaError_t launch_tree_attention_mma<Elem, 128, 4>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma<Elem, 128, 8>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma<Elem, 256, 4>(const TreeAttentionParams&, cudaStream_t); \
  template cudaError_t launch_tree_attention_mma_dispatch<Elem>(const TreeAttentionParams&, int, cudaStream_t);

SPECDEC_TREE_ATTN_MMA(__half)
SPECDEC_TREE_ATTN_MMA(__nv_bfloat16)
#undef SPECDEC_TREE_ATTN_MMA

template cudaError_t launch_tree_attention_simt<float>(const TreeAttentionParams&, cudaStream_t);
template cudaError_t launch_tree_attention_simt<__half>(const TreeAttentionParams&, cudaStream_t);
template cudaError_t launch_tree_attention_simt<__nv_bfloat16>(const TreeAttentionParams&, cudaStream_t);

}  // namespace cuda
}  // namespace specdec
