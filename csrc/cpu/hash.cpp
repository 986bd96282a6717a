// ZEN's hierarchical hashing on the CPU (semantics in ops.h, hash functions in ../hash.h).
//
// The semantics are round-synchronous: in each round a slot that is empty at the round's
// start goes to the lowest position trying it. Partitions never share slots, so each one is
// filled on its own, and inside one partition a scan in ascending position that takes a slot
// whenever it is still empty gives exactly that result (a slot taken earlier in the same
// round was taken by a lower position, which is the round's winner anyway). So:
//   pass 1 (parallel over chunks): h_0 of every index and per-chunk partition histograms;
//   pass 2 (parallel over chunks): positions grouped by partition, ascending inside each
//          (a stable counting sort: each chunk writes from its own exclusive-scan offsets);
//   pass 3 (parallel over partitions): the rounds of insertion into the partition's parallel
//          memory, then its occupied slots in slot order and what is still pending (the
//          serial memory, ascending) are written over the partition's range of the output.
// Work O(m * rounds + occupied slots), memory O(m + threads * table_size); the tables hold
// int32 positions when m < 2^31. Pass 3 uses as
// many threads as there are partitions (the paper's P is the number of workers).
#include "../ops.h"
#include "../checks.h"
#include "../hash.h"
#include "common.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>
#include <vector>

namespace ssf {
namespace {

using cpu::Chunks;
using hashing::hash_to;
using hashing::round_seed;

// I: index type; J: position type of the tables (int32 when m fits: half the cache misses).
template <typename I, typename J>
void hash_partition_impl(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int64_t r1,
                         int64_t rounds, int64_t* order, int64_t* counts, int64_t* overflow) {
  std::fill(counts, counts + nparts, int64_t(0));
  std::fill(overflow, overflow + nparts, int64_t(0));
  if (m == 0) return;
  const uint64_t s0 = round_seed(seed, 0);
  // Chunks of at least nparts elements keep the histograms within O(m + nparts).
  const Chunks ch(m, std::max<int64_t>(int64_t(1) << 15, nparts));
  std::vector<int32_t> part(m);
  std::vector<int64_t> hist(ch.count * nparts, 0);
  ch.for_each([&](int64_t c) {  // pass 1
    int64_t* h = hist.data() + c * nparts;
    for (int64_t j = ch.begin(c), e = ch.end(c); j < e; ++j) {
      const int32_t p = static_cast<int32_t>(hash_to(static_cast<int64_t>(idx[j]), s0, nparts));
      part[j] = p;
      ++h[p];
    }
  });
  // Partition-major, chunk-minor offsets: hist[c][p] becomes where chunk c writes partition p.
  std::vector<int64_t> start(nparts + 1, 0);
  int64_t run = 0;
  for (int64_t p = 0; p < nparts; ++p) {
    start[p] = run;
    for (int64_t c = 0; c < ch.count; ++c) {
      const int64_t v = hist[c * nparts + p];
      hist[c * nparts + p] = run;
      run += v;
    }
    counts[p] = run - start[p];
  }
  start[nparts] = run;
  ch.for_each([&](int64_t c) {  // pass 2: order holds the grouped positions for now
    int64_t* o = hist.data() + c * nparts;
    for (int64_t j = ch.begin(c), e = ch.end(c); j < e; ++j) order[o[part[j]]++] = j;
  });
  std::vector<uint64_t> seeds(rounds);
  for (int64_t r = 0; r < rounds; ++r) seeds[r] = round_seed(seed, r + 1);
  at::parallel_for(0, nparts, 1, [&](int64_t b, int64_t e) {  // pass 3
    // Per thread, reused across partitions: an occupancy bitset (small enough to stay in
    // cache, so the collision test is cheap) and the occupants, written but never read
    // while inserting.
    std::vector<uint64_t> used;
    std::vector<J> table, pending;
    std::vector<int64_t> slots;
    for (int64_t p = b; p < e; ++p) {
      const int64_t lo = start[p], hi = start[p + 1];
      if (hi == lo) continue;
      pending.assign(order + lo, order + hi);
      slots.clear();
      if (rounds > 0 && table.empty()) {
        used.assign((r1 + 63) / 64, 0);
        table.resize(r1);
      }
      for (int64_t r = 0; r < rounds && !pending.empty(); ++r) {
        size_t keep = 0;
        for (size_t t = 0; t < pending.size(); ++t) {
          const J j = pending[t];
          const int64_t s = hash_to(static_cast<int64_t>(idx[j]), seeds[r], r1);
          const uint64_t bit = uint64_t(1) << (s & 63);
          if (!(used[s >> 6] & bit)) {
            used[s >> 6] |= bit;
            table[s] = j;
            slots.push_back(s);
          } else {
            pending[keep++] = j;
          }
        }
        pending.resize(keep);
      }
      // Parallel memory in slot order: sort the few occupied slots, or scan the bitset.
      int64_t o = lo;
      if (int64_t(slots.size()) * 16 < r1) {
        std::sort(slots.begin(), slots.end());
        for (const int64_t s : slots) order[o++] = table[s];
        for (const int64_t s : slots) used[s >> 6] = 0;
      } else if (!slots.empty()) {
        for (size_t w = 0; w < used.size(); ++w) {
          for (uint64_t word = used[w]; word != 0; word &= word - 1)
            order[o++] = table[int64_t(w) * 64 + __builtin_ctzll(word)];
          used[w] = 0;
        }
      }
      for (const J j : pending) order[o++] = j;  // serial memory, input order
      overflow[p] = int64_t(pending.size());
    }
  });
}

template <typename I>
void hash_owner_impl(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int32_t* out) {
  const uint64_t s0 = round_seed(seed, 0);
  at::parallel_for(0, m, int64_t(1) << 15, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j)
      out[j] = static_cast<int32_t>(hash_to(static_cast<int64_t>(idx[j]), s0, nparts));
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_partition_cpu(const at::Tensor& indices_in,
                                                                  int64_t nparts, int64_t seed,
                                                                  int64_t table_size,
                                                                  int64_t rounds) {
  check_hash_args(indices_in, nparts, table_size, rounds, at::kCPU, "hash_partition");
  const at::Tensor indices = indices_in.contiguous();
  const int64_t m = indices.numel();
  at::Tensor order, counts, overflow;
  std::tie(order, counts, overflow) = hash_partition_outputs(indices, nparts);
  const uint64_t s = static_cast<uint64_t>(seed);
  // J, the tables' position type, is the index type of positions in [0, m).
  dispatch_index(indices.scalar_type(), [&](auto i_tag) {
    dispatch_index(index_dtype_for(m), [&](auto j_tag) {
      using I = decltype(i_tag);
      using J = decltype(j_tag);
      hash_partition_impl<I, J>(indices.const_data_ptr<I>(), m, nparts, s, table_size, rounds,
                                order.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
                                overflow.data_ptr<int64_t>());
    });
  });
  return {order, counts, overflow};
}

at::Tensor hash_owner_cpu(const at::Tensor& indices_in, int64_t nparts, int64_t seed) {
  check_hash_args(indices_in, nparts, 1, 0, at::kCPU, "hash_owner");
  const at::Tensor indices = indices_in.contiguous();
  const int64_t m = indices.numel();
  at::Tensor out = at::empty({m}, indices.options().dtype(at::kInt));
  const uint64_t s = static_cast<uint64_t>(seed);
  dispatch_index(indices.scalar_type(), [&](auto i_tag) {
    using I = decltype(i_tag);
    hash_owner_impl<I>(indices.const_data_ptr<I>(), m, nparts, s, out.data_ptr<int32_t>());
  });
  return out;
}

}  // namespace ssf
