// Layout of a sparse record, the codec's wire format: defined here once for the CPU codec
// (csrc/cpu/codec.cpp, whose record_spans() ops.py checks its pure-torch copy against) and
// the CUDA kernels (csrc/cuda/codec.cu). No ATen here, so the raw CUDA kernels can include it.
//
// A record of k elements inside a buffer of value-sized elements holds the k values, zero
// padding up to a multiple of index_bytes/value_bytes values, then the k indices bit for
// bit. The padding makes the indices start on an index-size boundary (given an aligned
// record start), which lets decoders read them in place.
#pragma once

#include <cstdint>

namespace ssf {

// Spans of a record, counted in value elements.
struct RecordSpans {
  int64_t values;   // the k values and their padding
  int64_t indices;  // the k indices
};

// The spans of a record of k elements; index_bytes and value_bytes must divide one another.
inline RecordSpans record_layout(int64_t k, int64_t value_bytes, int64_t index_bytes) {
  const int64_t per = index_bytes > value_bytes ? index_bytes / value_bytes : 1;
  return {(k + per - 1) / per * per, (k * index_bytes + value_bytes - 1) / value_bytes};
}

}  // namespace ssf
