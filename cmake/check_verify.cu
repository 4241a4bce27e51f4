// Torch-free translation unit for the compile check (CMakeLists.txt, target compile_check):
// instantiates the verify planner and launcher for every logits dtype the glue
// (csrc/cuda/verify.cu) uses, so ptxas reports registers and spills for each kernel (the
// draft_probs dtype is a run-time argument). Never linked into the extension.
#include "specdec/verify.cuh"

namespace specdec {
namespace cuda {

#define SPECDEC_INSTANTIATE_VERIFY(LogitT)                                                    \
  template cudaError_t plan_verify<LogitT>(int64_t, int64_t, int64_t, bool, VerifyPlan*); \
  template cudaError_t launch_verify<LogitT>(const VerifyArgs&, const VerifyPlan&, void*, cudaStream_t);

SPECDEC_INSTANTIATE_VERIFY(float)
SPECDEC_INSTANTIATE_VERIFY(__nv_bfloat16)
SPECDEC_INSTANTIATE_VERIFY(__half)

#undef SPECDEC_INSTANTIATE_VERIFY

}  // namespace cuda
}  // namespace specdec
