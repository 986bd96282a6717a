// pybind11 bindings of ssfusion_hvd._C: binding only, no logic (ops.h has the semantics,
// ssfusion_hvd/ops.py does the dispatch and the pure-torch fallback).
#include <torch/extension.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ssfusion_hvd native kernels (see csrc/ops.h)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("topk_cpu", &ssf::topk_cpu, py::arg("x"), py::arg("k"), nogil);
  m.def("segmented_topk_cpu", &ssf::segmented_topk_cpu, py::arg("flat"), py::arg("offsets"),
        py::arg("ks"), nogil);
  m.def("sampled_threshold_cpu", &ssf::sampled_threshold_cpu, py::arg("x"), py::arg("k"),
        py::arg("samples"), nogil);
  m.def("threshold_select_cpu", &ssf::threshold_select_cpu, py::arg("x"), py::arg("thr"), nogil);
  m.def("threshold_count_cpu", &ssf::threshold_count_cpu, py::arg("x"), py::arg("thr"), nogil);
  m.def("pack_cpu", &ssf::pack_cpu, py::arg("values"), py::arg("indices"), py::arg("out"),
        py::arg("offset"), nogil);
  m.def("scatter_add_cpu", &ssf::scatter_add_cpu, py::arg("dense"), py::arg("values"),
        py::arg("indices"), nogil);
  m.def("scatter_add_chunks_cpu", &ssf::scatter_add_chunks_cpu, py::arg("dense"),
        py::arg("gathered"), py::arg("nchunks"), py::arg("chunk_len"), py::arg("offset"),
        py::arg("k"), py::arg("index_dtype"), nogil);
  m.def("hash_partition_cpu", &ssf::hash_partition_cpu, py::arg("indices"), py::arg("nparts"),
        py::arg("seed"), py::arg("table_size"), py::arg("rounds"), nogil);
  m.def("hash_owner_cpu", &ssf::hash_owner_cpu, py::arg("indices"), py::arg("nparts"),
        py::arg("seed"), nogil);
  m.def("record_spans", &ssf::record_spans, py::arg("k"), py::arg("value_dtype"),
        py::arg("index_dtype"));
#ifdef SSF_WITH_CUDA
  m.def("topk_cuda", &ssf::topk_cuda, py::arg("x"), py::arg("k"), nogil);
  m.def("segmented_topk_cuda", &ssf::segmented_topk_cuda, py::arg("flat"), py::arg("offsets"),
        py::arg("ks"), nogil);
  m.def("sampled_threshold_cuda", &ssf::sampled_threshold_cuda, py::arg("x"), py::arg("k"),
        py::arg("samples"), nogil);
  m.def("threshold_select_cuda", &ssf::threshold_select_cuda, py::arg("x"), py::arg("thr"), nogil);
  m.def("threshold_count_cuda", &ssf::threshold_count_cuda, py::arg("x"), py::arg("thr"), nogil);
  m.def("pack_cuda", &ssf::pack_cuda, py::arg("values"), py::arg("indices"), py::arg("out"),
        py::arg("offset"), nogil);
  m.def("scatter_add_cuda", &ssf::scatter_add_cuda, py::arg("dense"), py::arg("values"),
        py::arg("indices"), nogil);
  m.def("scatter_add_chunks_cuda", &ssf::scatter_add_chunks_cuda, py::arg("dense"),
        py::arg("gathered"), py::arg("nchunks"), py::arg("chunk_len"), py::arg("offset"),
        py::arg("k"), py::arg("index_dtype"), nogil);
  m.def("hash_partition_cuda", &ssf::hash_partition_cuda, py::arg("indices"), py::arg("nparts"),
        py::arg("seed"), py::arg("table_size"), py::arg("rounds"), nogil);
  m.def("hash_owner_cuda", &ssf::hash_owner_cuda, py::arg("indices"), py::arg("nparts"),
        py::arg("seed"), nogil);
#endif
  py::dict info;
  info["cuda_kernels"] =
#ifdef SSF_WITH_CUDA
      true;
#else
      false;
#endif
  info["cuda_sources_compiled"] =
#ifdef SSF_CUDA_COMPILED
      true;
#else
      false;
#endif
  m.attr("build_info") = info;
}
