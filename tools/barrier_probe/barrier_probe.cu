// Does a grid barrier between blocks complete under compute-sanitizer? The verify kernel
// (csrc/include/specdec/verify.cuh, VerifyGroup::sync) splits a row's vocabulary over `chunks`
// co-resident blocks of a cooperative launch that meet at a spin barrier on a global counter.
// Its sanitized runs never finished in the second GPU window. This program runs the same
// barrier, alone, in four launch variants, and reports per variant whether every block passed
// every barrier, saw the others' writes, and how long it took; a barrier that waits more than
// --limit seconds (globaltimer) gives up and counts as timed out instead of hanging.
//
//   nvcc -O2 -arch=sm_90a -o barrier_probe barrier_probe.cu
//   ./barrier_probe VARIANT CHUNKS GROUPS PHASES [LIMIT_S]
//   VARIANT: ex (cudaLaunchKernelEx + cooperative attribute: what verify does) | coop
//            (cudaLaunchCooperativeKernel) | plain (an ordinary launch) | cg (cooperative
//            launch, cooperative_groups::this_grid().sync() instead of the counter)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                        \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::printf("barrier_probe: %s: %s\n", #call, cudaGetErrorString(e_));               \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Flags {
  unsigned int mismatches;  // a block read a slot that did not hold that phase's value
  unsigned int timeouts;    // a barrier given up after the limit
  unsigned long long max_wait_ns;
};

// VerifyGroup::sync's barrier, with a time limit on the wait. Returns false on timeout.
__device__ bool counter_sync(unsigned int* counter, int chunks, unsigned int phase, unsigned long long limit_ns,
                             Flags* flags) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    ok = 1;
    const unsigned int target = (phase + 1u) * static_cast<unsigned int>(chunks);
    __threadfence();
    atomicAdd(counter, 1u);
    const unsigned long long start = now_ns();
    unsigned int seen;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if (static_cast<int>(seen - target) >= 0) break;
      if (now_ns() - start > limit_ns) {
        atomicAdd(&flags->timeouts, 1u);
        ok = 0;
        break;
      }
      __nanosleep(32);
    }
    atomicMax(&flags->max_wait_ns, now_ns() - start);
    __threadfence();
  }
  __syncthreads();
  return ok != 0;
}

template <bool kGridSync>
__global__ void barrier_kernel(int* slots, unsigned int* counters, int chunks, int phases, unsigned long long limit_ns,
                               Flags* flags) {
  const int group = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  int* mine = slots + static_cast<size_t>(group) * chunks * 2;
  for (int phase = 0; phase < phases; ++phase) {
    if (threadIdx.x == 0) mine[chunk * 2 + (phase & 1)] = phase * 1000 + chunk;
    if constexpr (kGridSync) {
      __threadfence();
      cooperative_groups::this_grid().sync();
    } else if (!counter_sync(counters + group, chunks, static_cast<unsigned int>(phase), limit_ns, flags)) {
      return;
    }
    if (threadIdx.x == 0) {
      for (int c = 0; c < chunks; ++c) {
        if (*static_cast<volatile int*>(&mine[c * 2 + (phase & 1)]) != phase * 1000 + c) atomicAdd(&flags->mismatches, 1u);
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::printf("usage: barrier_probe ex|coop|plain|cg CHUNKS GROUPS PHASES [LIMIT_S]\n");
    return 2;
  }
  const char* variant = argv[1];
  int chunks = std::atoi(argv[2]), groups = std::atoi(argv[3]), phases = std::atoi(argv[4]);
  const double limit_s = argc > 5 ? std::atof(argv[5]) : 5.0;
  const bool grid_sync = std::strcmp(variant, "cg") == 0;
  if (grid_sync) {  // one group: the whole grid meets at each barrier
    chunks *= groups;
    groups = 1;
  }
  const int blocks = chunks * groups, threads = 256;
  int device = 0, sms = 0, per_sm = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  void* kernel = grid_sync ? reinterpret_cast<void*>(barrier_kernel<true>) : reinterpret_cast<void*>(barrier_kernel<false>);
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));

  int* slots = nullptr;
  unsigned int* counters = nullptr;
  Flags* flags = nullptr;
  CHECK(cudaMalloc(&slots, sizeof(int) * blocks * 2));
  CHECK(cudaMalloc(&counters, sizeof(unsigned int) * groups));
  CHECK(cudaMalloc(&flags, sizeof(Flags)));
  CHECK(cudaMemset(slots, 0xff, sizeof(int) * blocks * 2));
  CHECK(cudaMemset(counters, 0, sizeof(unsigned int) * groups));
  CHECK(cudaMemset(flags, 0, sizeof(Flags)));
  unsigned long long limit_ns = static_cast<unsigned long long>(limit_s * 1e9);

  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  void* args[] = {&slots, &counters, &chunks, &phases, &limit_ns, &flags};
  if (std::strcmp(variant, "ex") == 0) {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(threads);
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&config, barrier_kernel<false>, slots, counters, chunks, phases, limit_ns, flags));
  } else if (std::strcmp(variant, "coop") == 0 || grid_sync) {
    CHECK(cudaLaunchCooperativeKernel(kernel, dim3(blocks), dim3(threads), args, 0, nullptr));
  } else if (std::strcmp(variant, "plain") == 0) {
    barrier_kernel<false><<<blocks, threads>>>(slots, counters, chunks, phases, limit_ns, flags);
    CHECK(cudaGetLastError());
  } else {
    std::printf("barrier_probe: unknown variant %s\n", variant);
    return 2;
  }
  CHECK(cudaEventRecord(stop));
  CHECK(cudaDeviceSynchronize());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  Flags host{};
  CHECK(cudaMemcpy(&host, flags, sizeof(Flags), cudaMemcpyDeviceToHost));
  const bool ok = host.mismatches == 0 && host.timeouts == 0;
  std::printf("barrier_probe %s: %s: %d group(s) x %d block(s), %d phases, capacity %d x %d SMs: %.1f ms, "
              "longest wait %.3f ms, %u timeouts, %u mismatches\n",
              variant, ok ? "ok" : "FAILED", groups, chunks, phases, per_sm, sms, ms, host.max_wait_ns / 1e6,
              host.timeouts, host.mismatches);
  return ok ? 0 : 1;
}
