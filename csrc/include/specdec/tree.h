// Token-tree masks on the CPU: plain C++ over raw pointers and strides, no torch.
//
// A tree of T nodes is parents[0..T): node 0 is the root, a real node i > 0 has
// 0 <= parents[i] < i (topological order), and parent -1 marks the root and trailing
// padding nodes. The ancestor mask row of node i has column j set iff j == i or j is an
// ancestor of i.
#pragma once

#include <algorithm>
#include <cstdint>

namespace specdec {
namespace cpu {

// Fills the [T, T] row-major ancestor mask of one tree. Returns -1 on success, else the
// first node whose parent is neither -1 nor an earlier node (rows from that node on are
// left unwritten; the caller reports the error).
template <typename Index>
int64_t tree_mask(const Index* parents, int64_t parent_stride, int64_t num_nodes, bool* mask) {
  for (int64_t i = 0; i < num_nodes; ++i) {
    const int64_t parent = static_cast<int64_t>(parents[i * parent_stride]);
    bool* row = mask + i * num_nodes;
    if (parent == -1) {
      std::fill(row, row + num_nodes, false);  // root or padding: sees only itself
    } else if (parent >= 0 && parent < i) {
      // Topological order means the parent's row is complete, and it can only have
      // columns <= parent set: copy that prefix and clear the rest.
      const bool* parent_row = mask + parent * num_nodes;
      std::copy(parent_row, parent_row + parent + 1, row);
      std::fill(row + parent + 1, row + num_nodes, false);
    } else {
      return i;
    }
    row[i] = true;
  }
  return -1;
}

// Packs one mask row of num_keys bools (element stride `stride`) into ceil(num_keys / 64)
// words: bit j % 64 of word j / 64 is row[j]. Bits past num_keys are zero.
inline void pack_mask_row(const bool* row, int64_t stride, int64_t num_keys, int64_t* words) {
  for (int64_t first = 0; first < num_keys; first += 64) {
    const int64_t count = std::min<int64_t>(64, num_keys - first);
    uint64_t word = 0;
    for (int64_t k = 0; k < count; ++k) {
      word |= static_cast<uint64_t>(row[(first + k) * stride]) << k;
    }
    // Reinterpreting as int64 puts column 63 of a word in the sign bit, as the contract says.
    words[first / 64] = static_cast<int64_t>(word);
  }
}

}  // namespace cpu
}  // namespace specdec
