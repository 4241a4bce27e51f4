"""The C++ Philox (csrc/include/specdec/philox.h, shared by the CPU and CUDA verify) against
the Python copy (`specdec_kernels.ops.philox`), bit for bit, without a GPU.

A small host program includes the header and prints the word and the uniform of each
(seed, node, purpose, index) it reads; it is built with the host C++ compiler, and also with
nvcc where one is installed (the header's __host__ __device__ path as nvcc compiles it for the
host). The CUDA device path differs only in how it forms the 64-bit product (__umulhi, the
round-to-nearest intrinsics); tools/compile_check.sh compiles it.
"""

import os
import shutil
import subprocess

import pytest
import torch

from specdec_kernels.ops import philox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(ROOT, "csrc", "include")

PROGRAM = r"""
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "specdec/philox.h"

int main() {
  unsigned long long seed, node, purpose, index;
  while (std::scanf("%llu %llu %llu %llu", &seed, &node, &purpose, &index) == 4) {
    const uint32_t word = specdec::philox::word0(static_cast<uint32_t>(index), static_cast<uint32_t>(node),
                                                 static_cast<uint32_t>(purpose), 0u, static_cast<uint32_t>(seed),
                                                 static_cast<uint32_t>(seed >> 32));
    const float u = specdec::philox::uniform(seed, static_cast<uint32_t>(node), static_cast<uint32_t>(purpose),
                                             static_cast<uint32_t>(index));
    uint32_t bits;
    std::memcpy(&bits, &u, sizeof(bits));
    std::printf("%" PRIu32 " %" PRIu32 "\n", word, bits);
  }
  return 0;
}
"""


def _compilers():
    found = []
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    if cxx:
        found.append(("host", [cxx, "-std=c++17", "-O2", "-x", "c++"]))
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None)
    if nvcc and os.path.exists(nvcc):
        found.append(("nvcc", [nvcc, "-std=c++17", "-O2", "-x", "cu"]))
    return found


COMPILERS = _compilers()


@pytest.fixture(scope="module", params=[name for name, _ in COMPILERS] or [pytest.param("none", marks=pytest.mark.skip("no C++ compiler"))])
def philox_program(request, tmp_path_factory):
    """Path of the header's test program built by one compiler."""
    command = dict(COMPILERS)[request.param]
    tmp = tmp_path_factory.mktemp(f"philox_{request.param}")
    source = tmp / "philox_test.cc"
    source.write_text(PROGRAM)
    binary = tmp / "philox_test"
    subprocess.run([*command, "-I", INCLUDE, str(source), "-o", str(binary)], check=True, capture_output=True)
    return binary


def _cases(gen, count):
    """(seed, node, purpose, index) rows: random 64-bit seeds (both signs as int64), random and
    edge-value nodes and indices (0, 2^32 - 1), both purposes."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (count,), generator=gen, dtype=torch.int64)
    nodes = torch.randint(0, 2**32, (count,), generator=gen, dtype=torch.int64)
    indices = torch.randint(0, 2**32, (count,), generator=gen, dtype=torch.int64)
    purposes = torch.randint(0, 3, (count,), generator=gen, dtype=torch.int64)
    edges = torch.tensor([0, 1, 2**31, 2**32 - 1])
    nodes[: len(edges)] = edges
    indices[len(edges) : 2 * len(edges)] = edges
    seeds[:4] = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    return seeds, nodes, purposes, indices


def test_cpp_philox_matches_python_bit_for_bit(philox_program, gen):
    seeds, nodes, purposes, indices = _cases(gen, 4000)
    lines = "".join(f"{int(s) & (2**64 - 1)} {int(n)} {int(p)} {int(i)}\n"
                    for s, n, p, i in zip(seeds, nodes, purposes, indices))
    out = subprocess.run([str(philox_program)], input=lines, capture_output=True, text=True, check=True).stdout.split()
    words = torch.tensor([int(w) for w in out[0::2]], dtype=torch.int64)
    uniform_bits = [int(b) for b in out[1::2]]
    assert len(words) == len(seeds)

    mask = philox.MASK32
    expected_words = philox.philox4x32_10(indices & mask, nodes & mask, purposes, torch.zeros_like(purposes),
                                          seeds & mask, (seeds >> 32) & mask)[0]
    assert torch.equal(words, expected_words)
    expected_uniforms = torch.empty(len(seeds), dtype=torch.float32)
    for purpose in purposes.unique().tolist():  # `uniform` takes one purpose per call
        rows = purposes == purpose
        expected_uniforms[rows] = philox.uniform(seeds[rows], nodes[rows], purpose, indices[rows])
    assert uniform_bits == expected_uniforms.view(torch.int32).to(torch.int64).bitwise_and(mask).tolist()
