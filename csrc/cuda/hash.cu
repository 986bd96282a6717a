// ZEN's hierarchical hashing on CUDA (see kernels.cuh; semantics in ../ops.h, hash functions
// in ../hash.h), with the CPU's results.
//
//   part:   one thread per index: h_0 gives the partition (atomic integer count per
//           partition); every index starts pending with the serial key p*(r1+1) + r1.
//   rounds: two launches per round. claim: a pending index whose slot h_i was empty at the
//           round's start bids its position with atomicMin on the slot's bid word; commit:
//           the bidder holding the minimum takes the slot and its key becomes p*(r1+1) + slot.
//           Integer atomicMin makes the winner the lowest position whatever the thread
//           schedule (Technique #4's read-after-write check, made deterministic); losers
//           stay pending for the next hash function.
//   order:  one stable radix sort of (key, position) pairs: keys order partitions, then
//           occupied slots in slot order, then the serial memory (equal keys) in ascending
//           position, which is exactly the output order; no compaction pass is needed.
// Memory: two words per slot (table, bids) plus O(m) keys and the sort's storage.
#include "kernels.cuh"
#include "common.cuh"

#include "../hash.h"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

namespace ssf {
namespace cuda {
namespace {

using ull = unsigned long long;
constexpr ull kEmpty = ~0ull;  // a free slot / no bid (memset 0xFF)
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

template <typename I>
__global__ void part_kernel(const I* __restrict__ idx, int64_t m, int64_t nparts, uint64_t s0,
                            int64_t r1, int32_t* __restrict__ part, ull* __restrict__ key,
                            long long* __restrict__ pos, ull* __restrict__ counts) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    const int64_t p = hashing::hash_to(static_cast<int64_t>(idx[j]), s0, nparts);
    part[j] = static_cast<int32_t>(p);
    key[j] = ull(p) * ull(r1 + 1) + ull(r1);  // pending: serial memory unless a round places it
    pos[j] = j;
    atomicAdd(counts + p, 1ull);
  }
}

// Slot (p*r1 + h_round) of a pending index, or -1 once placed.
template <typename I>
__device__ __forceinline__ int64_t pending_slot(const I* idx, const int32_t* part, const ull* key,
                                                int64_t j, uint64_t sr, int64_t r1) {
  const int64_t p = part[j];
  if (key[j] != ull(p) * ull(r1 + 1) + ull(r1)) return -1;
  return p * r1 + hashing::hash_to(static_cast<int64_t>(idx[j]), sr, r1);
}

template <typename I>
__global__ void claim_kernel(const I* __restrict__ idx, int64_t m, uint64_t sr, int64_t r1,
                             const int32_t* __restrict__ part, const ull* __restrict__ key,
                             const ull* __restrict__ table, ull* __restrict__ bids) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    const int64_t f = pending_slot(idx, part, key, j, sr, r1);
    if (f >= 0 && table[f] == kEmpty) atomicMin(bids + f, ull(j));
  }
}

// A bid word only ever holds positions that bid while the slot was free, and a round's
// winner is never pending again, so bids[f] == j identifies this round's winner of f.
template <typename I>
__global__ void commit_kernel(const I* __restrict__ idx, int64_t m, uint64_t sr, int64_t r1,
                              const int32_t* __restrict__ part, ull* __restrict__ key,
                              ull* __restrict__ table, const ull* __restrict__ bids) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    const int64_t f = pending_slot(idx, part, key, j, sr, r1);
    if (f >= 0 && bids[f] == ull(j)) {
      const int64_t p = part[j];
      table[f] = ull(j);
      key[j] = ull(p) * ull(r1 + 1) + ull(f - p * r1);
    }
  }
}

__global__ void overflow_kernel(int64_t m, int64_t r1, const int32_t* __restrict__ part,
                                const ull* __restrict__ key, ull* __restrict__ overflow) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride) {
    const int64_t p = part[j];
    if (key[j] == ull(p) * ull(r1 + 1) + ull(r1)) atomicAdd(overflow + p, 1ull);
  }
}

template <typename I>
__global__ void owner_kernel(const I* __restrict__ idx, int64_t m, int64_t nparts, uint64_t s0,
                             int32_t* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < m; j += stride)
    out[j] = static_cast<int32_t>(hashing::hash_to(static_cast<int64_t>(idx[j]), s0, nparts));
}

int key_bits(int64_t nparts, int64_t r1) {
  const ull max_key = ull(nparts) * ull(r1 + 1) - 1;
  int bits = 1;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  return bits;
}

struct HashLayout {
  ull *table = nullptr, *bids = nullptr, *key_in = nullptr, *key_out = nullptr;
  int32_t* part = nullptr;
  long long* pos = nullptr;
  void* sort_tmp = nullptr;
  size_t sort_bytes = 0;
};

HashLayout carve_hash(Carver& c, int64_t m, int64_t nparts, int64_t r1) {
  HashLayout L;
  const size_t slots = size_t(nparts) * size_t(r1);
  L.table = c.take<ull>(slots);
  L.bids = c.take<ull>(slots);
  L.part = c.take<int32_t>(size_t(m));
  L.key_in = c.take<ull>(size_t(m));
  L.key_out = c.take<ull>(size_t(m));
  L.pos = c.take<long long>(size_t(m));
  SSF_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, L.sort_bytes, (const ull*)nullptr,
                                                 (ull*)nullptr, (const long long*)nullptr,
                                                 (long long*)nullptr, m, 0,
                                                 key_bits(nparts, r1)));
  L.sort_tmp = c.take<char>(L.sort_bytes);
  return L;
}

}  // namespace

size_t hash_partition_workspace_bytes(int64_t m, int64_t nparts, int64_t table_size) {
  if (m <= 0) return 0;
  Carver c(nullptr);
  carve_hash(c, m, nparts, table_size);
  return c.off;
}

template <typename I>
void hash_partition(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int64_t r1,
                    int64_t rounds, int64_t* order, int64_t* counts, int64_t* overflow,
                    void* workspace, size_t workspace_bytes, cudaStream_t s) {
  SSF_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(nparts) * sizeof(int64_t), s));
  SSF_CUDA_CHECK(cudaMemsetAsync(overflow, 0, size_t(nparts) * sizeof(int64_t), s));
  if (m <= 0) return;
  Carver c(workspace);
  const HashLayout L = carve_hash(c, m, nparts, r1);
  c.require(workspace_bytes, "hash_partition");
  const size_t slots = size_t(nparts) * size_t(r1);
  SSF_CUDA_CHECK(cudaMemsetAsync(L.table, 0xFF, slots * sizeof(ull), s));
  SSF_CUDA_CHECK(cudaMemsetAsync(L.bids, 0xFF, slots * sizeof(ull), s));
  const unsigned grid = grid_for(m, kThreads, kMaxBlocks);
  part_kernel<I><<<grid, kThreads, 0, s>>>(idx, m, nparts, hashing::round_seed(seed, 0), r1,
                                           L.part, L.key_in, L.pos,
                                           reinterpret_cast<ull*>(counts));
  SSF_CUDA_CHECK_LAUNCH();
  for (int64_t r = 1; r <= rounds; ++r) {
    const uint64_t sr = hashing::round_seed(seed, r);
    claim_kernel<I><<<grid, kThreads, 0, s>>>(idx, m, sr, r1, L.part, L.key_in, L.table, L.bids);
    SSF_CUDA_CHECK_LAUNCH();
    commit_kernel<I><<<grid, kThreads, 0, s>>>(idx, m, sr, r1, L.part, L.key_in, L.table, L.bids);
    SSF_CUDA_CHECK_LAUNCH();
  }
  overflow_kernel<<<grid, kThreads, 0, s>>>(m, r1, L.part, L.key_in,
                                            reinterpret_cast<ull*>(overflow));
  SSF_CUDA_CHECK_LAUNCH();
  size_t bytes = L.sort_bytes;
  SSF_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(L.sort_tmp, bytes, L.key_in, L.key_out, L.pos,
                                                 reinterpret_cast<long long*>(order), m, 0,
                                                 key_bits(nparts, r1), s));
}

template <typename I>
void hash_owner(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int32_t* out,
                cudaStream_t s) {
  if (m <= 0) return;
  const unsigned grid = grid_for(m, kThreads, kMaxBlocks);
  owner_kernel<I><<<grid, kThreads, 0, s>>>(idx, m, nparts, hashing::round_seed(seed, 0), out);
  SSF_CUDA_CHECK_LAUNCH();
}

#define SSF_INST_I(I)                                                                         \
  template void hash_partition<I>(const I*, int64_t, int64_t, uint64_t, int64_t, int64_t,      \
                                  int64_t*, int64_t*, int64_t*, void*, size_t, cudaStream_t); \
  template void hash_owner<I>(const I*, int64_t, int64_t, uint64_t, int32_t*, cudaStream_t);
SSF_FOR_EACH_I(SSF_INST_I)

}  // namespace cuda
}  // namespace ssf
