// Torch-free translation unit for the compile check (CMakeLists.txt, target compile_check):
// explicitly instantiates every kernel template in csrc/include/specdec/*.cuh with the
// arguments the torch glue uses, so ptxas reports registers and spills for each of them
// even where the glue cannot be compiled. Never linked into the extension.
#include "specdec/kv_cache.cuh"
#include "specdec/ngram.cuh"
#include "specdec/tree.cuh"

namespace specdec {
namespace cuda {

template cudaError_t launch_tree_mask<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t, bool*,
                                               cudaStream_t);
template cudaError_t launch_tree_mask<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int64_t, bool*,
                                               cudaStream_t);
template cudaError_t launch_pack_tree_mask<uint8_t>(const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                    int64_t, int64_t*, cudaStream_t);
template cudaError_t launch_compact_kv_cache<kCompactMaxCaches, kCompactPathChunk>(
    const KvCacheView*, int64_t, const int32_t*, const int32_t*, const int32_t*, int64_t, int32_t, int32_t*,
    cudaStream_t);
template cudaError_t launch_ngram_propose<int64_t>(const int64_t*, int64_t, int64_t, const int64_t*, int64_t, int64_t,
                                                   int64_t, int64_t, int64_t, bool, int64_t*, int32_t*, cudaStream_t);
template cudaError_t launch_ngram_propose<int32_t>(const int32_t*, int64_t, int64_t, const int64_t*, int64_t, int64_t,
                                                   int64_t, int64_t, int64_t, bool, int32_t*, int32_t*, cudaStream_t);
template cudaError_t launch_ngram_propose_tree<int64_t>(const int64_t*, int64_t, int64_t, const int64_t*, int64_t,
                                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                                                        int32_t*, int64_t*, int64_t*, int64_t*, cudaStream_t);
template cudaError_t launch_ngram_propose_tree<int32_t>(const int32_t*, int64_t, int64_t, const int64_t*, int64_t,
                                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                                                        int32_t*, int64_t*, int32_t*, int64_t*, cudaStream_t);

}  // namespace cuda
}  // namespace specdec
