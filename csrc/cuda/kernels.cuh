// Raw CUDA API of the ssfusion_hvd kernels: plain pointers + cudaStream_t, no torch.
//
// The torch glue (glue.cu, under SSF_WITH_CUDA) validates tensors and calls these; without
// SSF_WITH_CUDA the .cu files still build with nvcc alone (CI compile check).
//
// Conventions (the same as csrc/ops.h and the CPU kernels in csrc/cpu/):
//   * Values are handled as raw bits U: uint32_t for float32, uint16_t for float16/bfloat16.
//     The magnitude key is the bits with the sign bit cleared, compared unsigned, so NaN
//     ranks above +Inf. Selection ops copy values bit for bit.
//   * Index type I is int32_t or int64_t; selections come out in ascending index order,
//     ties at the k-th key go to the lower indices.
//   * Every op runs on the given stream only; none synchronizes the host except
//     threshold_count_result() and sampled_threshold(), which must return a host value.
//     Errors from the CUDA runtime are thrown as std::runtime_error (pybind11 turns them
//     into RuntimeError).
//   * Temporary device memory is caller-provided: query *_workspace_bytes(), allocate that
//     many bytes 256-byte aligned (e.g. torch's caching allocator), pass it in. The
//     workspace must stay allocated until the stream has run the work (stream-ordered
//     allocators such as torch's satisfy this when the same stream is used).
//   * Bad indices (scatter ops) cannot be reported without a sync: they fail a device-side
//     assertion (like torch's own index kernels) and are never written.
#pragma once

#include "../record.h"  // the record layout of the codec ops

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ssf {
namespace cuda {

// Arithmetic type of the raw bits (only the scatter-add ops do arithmetic).
enum class ValueKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Throws on a CUDA runtime error, naming the call site.
inline void check(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("ssfusion_hvd CUDA error in ") + what + " (" + file +
                             ":" + std::to_string(line) + "): " + cudaGetErrorString(err));
  }
}
#define SSF_CUDA_CHECK(expr) ::ssf::cuda::check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, not later.
#define SSF_CUDA_CHECK_LAUNCH() ::ssf::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ----------------------------------------------------------------------------- selection

// Exact magnitude top-k of x[0, n): out_v/out_i receive k values (bits) and indices in
// ascending index order. 0 <= k <= n. No host synchronization. Workspace:
// topk_workspace_bytes(n, k), which is 0 (workspace may then be null) for k = 0, k = n and
// inputs small enough for the one-block path.
template <typename U>
size_t topk_workspace_bytes(int64_t n, int64_t k);
template <typename U, typename I>
void topk(const U* x, int64_t n, int64_t k, U* out_v, I* out_i, void* workspace,
          size_t workspace_bytes, cudaStream_t stream);

// Threshold select keeps isnan(v) || (double)|v| >= thr. On the key this is exactly
// key >= threshold_key(thr, kind) (the predicate is monotone in the key), computed on the
// host once so the device compares integers only. thr must not be NaN.
uint32_t threshold_key(double thr, ValueKind kind);

// Two phases, sharing one workspace: threshold_prepare counts per tile and scans the
// counts (async); threshold_count_result copies the total to the host (the one sync);
// threshold_write compacts into outputs of that size (async).
template <typename U>
size_t threshold_workspace_bytes(int64_t n);
template <typename U>
void threshold_prepare(const U* x, int64_t n, uint32_t key_min, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);
int64_t threshold_count_result(const void* workspace, int64_t n, cudaStream_t stream);
template <typename U, typename I>
void threshold_write(const U* x, int64_t n, uint32_t key_min, U* out_v, I* out_i,
                     const void* workspace, cudaStream_t stream);

// Segmented top-k (segmented.cu): segment s is x[off[s], off[s+1]) and gives ks[s]
// elements, in index order, segments concatenated in order; indices are positions in x.
// One call runs a fixed number of launches whatever the number of segments. The host
// plan is made from host offsets/ks into `meta` (segmented_meta_len(nseg) int64s); the
// caller copies meta to the device (e.g. one non-blocking copy from pinned memory) and
// passes the device copy. Validates (throws on) bad segments or k. radix_all: run the
// radix passes even for k == len segments (their k-th key is then computed too).
struct SegmentedPlan {
  int64_t nseg = 0;
  int64_t k_total = 0;      // output length: sum of ks
  int64_t hist_blocks = 0;  // blocks of each histogram launch
  int64_t tiles = 0;        // blocks of each compaction launch
};
int64_t segmented_meta_len(int64_t nseg);
SegmentedPlan segmented_plan(const int64_t* offsets, const int64_t* ks, int64_t nseg,
                             int64_t* meta, bool radix_all);
template <typename U>
size_t segmented_topk_workspace_bytes(const SegmentedPlan& plan);
template <typename U, typename I>
void segmented_topk(const U* x, const SegmentedPlan& plan, const int64_t* meta_device, U* out_v,
                    I* out_i, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// DGC's sampled threshold (segmented.cu): the ceil(k*samples/n)-th largest float magnitude
// (NaN as +Inf) of x[sample_position(n, samples, j, sample_stream(seed))], j < samples
// (../sampling.h: one seeded draw per stratum; samples clamped to [1, n]), exactly like the
// CPU; 1 <= k <= n. Synchronizes the stream once to return the value.
size_t sampled_threshold_workspace_bytes(int64_t n, int64_t samples);
template <typename U>
double sampled_threshold(const U* x, int64_t n, int64_t k, int64_t samples, uint64_t seed,
                         ValueKind kind, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

// ----------------------------------------------------------------------------- error feedback

// ef_topk (../ops.h) with a float32 residual: residual[i] += grad[i] (grad_kind: float32, or
// float16/bfloat16 widened exactly; one float32 add, as on the CPU), the top k of the sums
// exactly as topk returns them (out_v: float32 bits), and the k selected entries of the
// residual replaced by their wire error (apply_wire_error). The sums are formed in the
// first radix pass, which writes them back and histograms them from registers: gradient
// and residual are read once and the residual written once before the other passes read it
// as topk reads its input (small inputs: one accumulate launch, then topk's one-block path).
// Workspace: topk_workspace_bytes<uint32_t>(n, k), possibly 0 and null. No host sync.
template <typename I>
void ef_topk_f32(const void* grad, ValueKind grad_kind, float* residual, int64_t n, int64_t k,
                 ValueKind wire_kind, uint32_t* out_v, I* out_i, void* workspace,
                 size_t workspace_bytes, cudaStream_t stream);

// residual[indices[j]] = what the wire (wire_kind) loses of values[j], j < k: +0 when it
// carries the residual's kind (acc_kind) exactly, else v - v rounded to wire_kind for a
// float32 residual (a 16-bit residual is sent in its own kind). One launch, no host sync.
template <typename U, typename I>
void apply_wire_error(U* residual, ValueKind acc_kind, ValueKind wire_kind, const U* values,
                      const I* indices, int64_t k, cudaStream_t stream);

// ----------------------------------------------------------------------------- codec

// Writes the record (values[0,k), indices[0,k)) at element `offset` of `out`; returns the
// offset just past it. The caller has checked that it fits. All pointers on the device.
template <typename U, typename I>
int64_t pack(const U* values, const I* indices, int64_t k, U* out, int64_t offset,
             cudaStream_t stream);

// dense[idx[j]] += v[j] for j = 0..k-1 in that order, rounding to the value type after
// every add, exactly like the CPU loop. Deterministic (no float atomics): the (index, j)
// pairs are stably radix-sorted by index, then one thread per distinct index adds its
// values in ascending j. 0 <= idx[j] < n is asserted on the device.
template <typename I>
size_t scatter_add_workspace_bytes(int64_t k);
template <typename U, typename I>
void scatter_add(U* dense, int64_t n, ValueKind kind, const U* values, const I* indices,
                 int64_t k, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// For p = 0..nchunks-1 in order: the record of k elements at element `offset` of chunk p
// (elements [p*chunk_len, (p+1)*chunk_len) of `gathered`) is added into dense. One launch
// per chunk, in stream order, so the summation order is the CPU's; indices are distinct
// within a chunk, so a chunk's adds need no atomics. Indices are read word by word, so the
// record may start at any value-aligned position.
template <typename U, typename I>
void scatter_add_chunks(U* dense, int64_t n, ValueKind kind, const U* gathered,
                        int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k,
                        cudaStream_t stream);
// The same into a float32 `dense` from float16/bfloat16 records (`kind`): every value is
// converted exactly, then added in float32 (round to nearest even), like the CPU.
template <typename I>
void scatter_add_chunks_widen(float* dense, int64_t n, ValueKind kind, const uint16_t* gathered,
                              int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k,
                              cudaStream_t stream);

// The rest of a sparse decode after scatter_add_chunks into `out` (semantics of
// ssf::deliver_chunks_cpu in ../ops.h): for the records of chunk 0, 1, ... in order, every
// named position i where out does not hold +0 is cleared and, if i < numel, delivered:
// out[i] * scale (in float, rounded to out_kind, skipped when scale == 1) converted to
// tensor_kind, into element i - bounds[t] of tensor t. `meta` (device,
// deliver_meta_len(ntensors) int64s) holds the bounds b_0 = 0 .. b_T = numel, then the T
// tensors' data pointers; out_kind is tensor_kind, or kFloat32 for 16-bit tensors; the
// records hold values of tensor_kind. One launch per chunk, in stream order (a position is
// taken by the first chunk that names it); the tensor of a position is found by binary
// search over the bounds. *nonfinite (device int64, zeroed by the caller) receives the
// number of delivered values that are NaN or +-Inf. No host sync.
int64_t deliver_meta_len(int64_t ntensors);
template <typename I>
void deliver_chunks(void* out, ValueKind out_kind, int64_t out_n, ValueKind tensor_kind,
                    const int64_t* meta, int64_t ntensors, int64_t numel, const void* gathered,
                    int64_t nchunks, int64_t chunk_len, int64_t offset, int64_t k, double scale,
                    int64_t* nonfinite, cudaStream_t stream);

// ----------------------------------------------------------------------------- hash

// ZEN's hierarchical hashing (hash.cu; semantics of ssf::hash_partition_cpu in ops.h, hash
// functions in ../hash.h): positions of idx[0, m) grouped by partition into order[m],
// entries per partition into counts[nparts], serial-memory entries into overflow[nparts]
// (all int64, on the device). The same results as the CPU; no host synchronization.
size_t hash_partition_workspace_bytes(int64_t m, int64_t nparts, int64_t table_size);
template <typename I>
void hash_partition(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int64_t table_size,
                    int64_t rounds, int64_t* order, int64_t* counts, int64_t* overflow,
                    void* workspace, size_t workspace_bytes, cudaStream_t stream);
// out[j] = h_0(idx[j]), the partition of each index (int32).
template <typename I>
void hash_owner(const I* idx, int64_t m, int64_t nparts, uint64_t seed, int32_t* out,
                cudaStream_t stream);

// Shared moments (csrc/moments.h, ops.h): one launch per batch of up to kMomentBatch tensors,
// a row of blocks per tensor; float32 throughout, every pointer to n[i] elements.
constexpr int kMomentBatch = 32;
struct MomentBatch {
  int count;
  float* p[kMomentBatch];
  const float* g[kMomentBatch];
  float* s1[kMomentBatch];  // SGD: the momentum buffer; Adam: exp_avg
  float* s2[kMomentBatch];  // Adam: exp_avg_sq (unused by SGD)
  float* age[kMomentBatch];
  int64_t n[kMomentBatch];
  float bias1[kMomentBatch], bias2_sqrt[kMomentBatch];  // Adam's, per tensor
};
void shared_momentum(const MomentBatch& batch, float lr, float momentum, float dampening,
                     bool nesterov, cudaStream_t stream);
void shared_adam(const MomentBatch& batch, float lr, float beta1, float beta2, float eps,
                 cudaStream_t stream);

// Adam's pending step as a selection key (ops.h, ef_step_key / step_denominator): one launch
// per batch of up to kKeyBatch tensors, a row of blocks per tensor. Tensor i's n[i]
// elements lie at v[i] (and g[i]) and at [off[i], off[i] + n[i]) of the flat residual and out.
constexpr int kKeyBatch = 32;
struct KeyBatch {
  int count;
  const float* g[kKeyBatch];  // nullptr in step_denominator
  const float* v[kKeyBatch];
  int64_t off[kKeyBatch];
  int64_t n[kKeyBatch];
  float bias2_sqrt[kKeyBatch];
};
// With `residual`: residual += g, out = |residual| / (sqrt(v) / b + eps); without (nullptr):
// out = sqrt(v) / b + eps. With `root` the denominator's square root (the key by the gain).
// Each operation rounded once, IEEE division and square root.
void step_key(const KeyBatch& batch, float* residual, float* out, float eps, bool root,
              cudaStream_t stream);

}  // namespace cuda
}  // namespace ssf
