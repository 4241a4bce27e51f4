// Torch-free translation unit for the compile check: the CPU kernel headers in
// csrc/include/specdec/ compile on their own with only the C++ standard library.
#include "specdec/kv_cache.h"
#include "specdec/tree.h"

template int64_t specdec::cpu::tree_mask<int64_t>(const int64_t*, int64_t, int64_t, bool*);
template int64_t specdec::cpu::tree_mask<int32_t>(const int32_t*, int64_t, int64_t, bool*);
