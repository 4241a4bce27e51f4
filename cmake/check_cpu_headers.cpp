// Torch-free translation unit for the compile check: the CPU kernel headers in
// csrc/include/specdec/ compile on their own with only the C++ standard library.
#include "specdec/kv_cache.h"
#include "specdec/ngram.h"
#include "specdec/ngram_index.h"
#include "specdec/small_linear.h"
#include "specdec/suffix_index.h"
#include "specdec/tree.h"
#include "specdec/tree_attention.h"
#include "specdec/verify.h"

template int64_t specdec::cpu::tree_mask<int64_t>(const int64_t*, int64_t, int64_t, bool*);
template int64_t specdec::cpu::tree_mask<int32_t>(const int32_t*, int64_t, int64_t, bool*);
template int64_t specdec::cpu::ngram_propose_row<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t, bool,
                                                          int64_t*);
template int64_t specdec::cpu::ngram_propose_row<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int64_t, bool,
                                                          int32_t*);
template void specdec::cpu::ngram_propose_tree_row<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                            int64_t, bool, int64_t*, int64_t*,
                                                            specdec::cpu::TreeScratch&);
template void specdec::cpu::ngram_propose_tree_row<int32_t>(const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                                            int64_t, bool, int32_t*, int64_t*,
                                                            specdec::cpu::TreeScratch&);
template int64_t specdec::cpu::NgramHistoryIndex::propose<int64_t>(int64_t, int64_t, int64_t, bool, int64_t*) const;
template int64_t specdec::cpu::SuffixCache::draft<int64_t>(int64_t, int64_t, int64_t, int64_t*, int64_t*, int32_t*) const;
template void specdec::cpu::SuffixCache::draft_rows<int64_t>(const int64_t*, int64_t, int64_t, int64_t, int64_t*, int64_t*,
                                                              int32_t*, int32_t*) const;
template void specdec::cpu::SuffixCache::append_rows<int64_t>(const int64_t*, const int64_t*, int64_t, const int64_t*,
                                                               int64_t);
template void specdec::cpu::SuffixCache::add<int64_t>(const int64_t*, int64_t);

namespace specdec::cpu {
#define SPECDEC_INSTANTIATE_VERIFY(Logit, Prob) \
  template int64_t verify_row<Logit, Prob>(const VerifyRow<Logit, Prob>&, VerifyScratch&, int32_t*, int64_t*);
#define SPECDEC_INSTANTIATE_VERIFY_ALL(Logit) \
  SPECDEC_INSTANTIATE_VERIFY(Logit, float)    \
  SPECDEC_INSTANTIATE_VERIFY(Logit, BFloat16Bits) \
  SPECDEC_INSTANTIATE_VERIFY(Logit, HalfBits)
SPECDEC_INSTANTIATE_VERIFY_ALL(float)
SPECDEC_INSTANTIATE_VERIFY_ALL(BFloat16Bits)
SPECDEC_INSTANTIATE_VERIFY_ALL(HalfBits)
#undef SPECDEC_INSTANTIATE_VERIFY_ALL
#undef SPECDEC_INSTANTIATE_VERIFY

#define SPECDEC_INSTANTIATE_TREE_ATTENTION(Scalar)                                                                   \
  template void attend_keys<Scalar>(const TreeAttentionProblem<Scalar>&, int64_t, int64_t, int64_t, int64_t,         \
                                    TreeAttentionScratch&);                                                           \
  template void write_output<Scalar>(const TreeAttentionProblem<Scalar>&, int64_t, int64_t,                          \
                                     const TreeAttentionScratch&);                                                    \
  template void save_partial<Scalar>(const TreeAttentionProblem<Scalar>&, const TreeAttentionScratch&, float*);      \
  template void combine_partials<Scalar>(const TreeAttentionProblem<Scalar>&, int64_t, int64_t, const float*, int64_t, \
                                         TreeAttentionScratch&);
SPECDEC_INSTANTIATE_TREE_ATTENTION(float)
SPECDEC_INSTANTIATE_TREE_ATTENTION(BFloat16Bits)
SPECDEC_INSTANTIATE_TREE_ATTENTION(HalfBits)
#undef SPECDEC_INSTANTIATE_TREE_ATTENTION
}  // namespace specdec::cpu
