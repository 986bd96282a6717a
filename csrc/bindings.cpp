// pybind11 bindings of ssfusion_hvd._C: binding only, no logic (ops.h has the semantics,
// ssfusion_hvd/ops.py does the dispatch and the pure-torch fallback).
#include <torch/extension.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ssfusion_hvd native kernels (see csrc/ops.h)";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // One device's ops (ops.h's SSF_DEVICE_OPS), bound as name_dev without the GIL.
#define SSF_BIND_DEVICE_OPS(dev)                                                              \
  m.def("topk_" #dev, &ssf::topk_##dev, py::arg("x"), py::arg("k"), nogil);                   \
  m.def("segmented_topk_" #dev, &ssf::segmented_topk_##dev, py::arg("flat"),                  \
        py::arg("offsets"), py::arg("ks"), nogil);                                            \
  m.def("sampled_threshold_" #dev, &ssf::sampled_threshold_##dev, py::arg("x"), py::arg("k"), \
        py::arg("samples"), py::arg("seed"), nogil);                                          \
  m.def("threshold_select_" #dev, &ssf::threshold_select_##dev, py::arg("x"), py::arg("thr"), \
        nogil);                                                                               \
  m.def("threshold_count_" #dev, &ssf::threshold_count_##dev, py::arg("x"), py::arg("thr"),   \
        nogil);                                                                               \
  m.def("ef_topk_" #dev, &ssf::ef_topk_##dev, py::arg("grad"), py::arg("residual"),           \
        py::arg("k"), py::arg("wire_dtype"), py::arg("velocity") = py::none(),                \
        py::arg("momentum") = 0.0, py::arg("mask_velocity") = false, nogil);                  \
  m.def("segmented_ef_topk_" #dev, &ssf::segmented_ef_topk_##dev, py::arg("grad"),            \
        py::arg("residual"), py::arg("offsets"), py::arg("ks"), py::arg("wire_dtype"),        \
        py::arg("velocity") = py::none(), py::arg("momentum") = 0.0,                          \
        py::arg("mask_velocity") = false, nogil);                                             \
  m.def("pack_" #dev, &ssf::pack_##dev, py::arg("values"), py::arg("indices"), py::arg("out"), \
        py::arg("offset"), nogil);                                                            \
  m.def("scatter_add_" #dev, &ssf::scatter_add_##dev, py::arg("dense"), py::arg("values"),    \
        py::arg("indices"), nogil);                                                           \
  m.def("scatter_add_chunks_" #dev, &ssf::scatter_add_chunks_##dev, py::arg("dense"),         \
        py::arg("gathered"), py::arg("nchunks"), py::arg("chunk_len"), py::arg("offset"),     \
        py::arg("k"), py::arg("index_dtype"), nogil);                                         \
  m.def("deliver_chunks_" #dev, &ssf::deliver_chunks_##dev, py::arg("out"),                   \
        py::arg("tensors"), py::arg("gathered"), py::arg("nchunks"), py::arg("chunk_len"),    \
        py::arg("offset"), py::arg("k"), py::arg("index_dtype"), py::arg("scale"), nogil);    \
  m.def("hash_partition_" #dev, &ssf::hash_partition_##dev, py::arg("indices"),               \
        py::arg("nparts"), py::arg("seed"), py::arg("table_size"), py::arg("rounds"), nogil); \
  m.def("hash_owner_" #dev, &ssf::hash_owner_##dev, py::arg("indices"), py::arg("nparts"),    \
        py::arg("seed"), nogil);                                                              \
  m.def("shared_momentum_step_" #dev, &ssf::shared_momentum_step_##dev, py::arg("params"),    \
        py::arg("grads"), py::arg("bufs"), py::arg("ages"), py::arg("lr"),                    \
        py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"), nogil);               \
  m.def("shared_adam_step_" #dev, &ssf::shared_adam_step_##dev, py::arg("params"),            \
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("ages"),       \
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("bias1"),  \
        py::arg("bias2_sqrt"), nogil);
  SSF_BIND_DEVICE_OPS(cpu)
  m.def("ef_topk_tensors_cpu", &ssf::ef_topk_tensors_cpu, py::arg("grads"), py::arg("residual"),
        py::arg("k"), py::arg("wire_dtype"), py::arg("velocity") = py::none(),
        py::arg("momentum") = 0.0, py::arg("mask_velocity") = false, nogil);
  m.def("segmented_ef_topk_tensors_cpu", &ssf::segmented_ef_topk_tensors_cpu, py::arg("grads"),
        py::arg("residual"), py::arg("offsets"), py::arg("ks"), py::arg("wire_dtype"),
        py::arg("velocity") = py::none(), py::arg("momentum") = 0.0,
        py::arg("mask_velocity") = false, nogil);
  m.def("group_ef_topk_cpu", &ssf::group_ef_topk_cpu, py::arg("grad"), py::arg("residual"),
        py::arg("offsets"), py::arg("floors"), py::arg("k"), py::arg("wire_dtype"),
        py::arg("velocity") = py::none(), py::arg("momentum") = 0.0,
        py::arg("mask_velocity") = false, nogil);
  m.def("group_ef_topk_tensors_cpu", &ssf::group_ef_topk_tensors_cpu, py::arg("grads"),
        py::arg("residual"), py::arg("offsets"), py::arg("floors"), py::arg("k"),
        py::arg("wire_dtype"), py::arg("velocity") = py::none(), py::arg("momentum") = 0.0,
        py::arg("mask_velocity") = false, nogil);
  m.def("ef_step_key_cpu", &ssf::ef_step_key_cpu, py::arg("grads"), py::arg("residual"),
        py::arg("exp_avg_sqs"), py::arg("bias2_sqrt"), py::arg("eps"), py::arg("key"),
        py::arg("root") = false, nogil);
  m.def("step_denominator_cpu", &ssf::step_denominator_cpu, py::arg("exp_avg_sqs"),
        py::arg("bias2_sqrt"), py::arg("eps"), py::arg("out"), py::arg("root") = false, nogil);
#ifdef SSF_WITH_CUDA
  SSF_BIND_DEVICE_OPS(cuda)
  m.def("ef_step_key_cuda", &ssf::ef_step_key_cuda, py::arg("grads"), py::arg("residual"),
        py::arg("exp_avg_sqs"), py::arg("bias2_sqrt"), py::arg("eps"), py::arg("key"),
        py::arg("root") = false, nogil);
  m.def("step_denominator_cuda", &ssf::step_denominator_cuda, py::arg("exp_avg_sqs"),
        py::arg("bias2_sqrt"), py::arg("eps"), py::arg("out"), py::arg("root") = false, nogil);
#endif
#undef SSF_BIND_DEVICE_OPS
  m.def("record_spans", &ssf::record_spans, py::arg("k"), py::arg("value_dtype"),
        py::arg("index_dtype"));
  m.def("cpu_parallel_threads", &ssf::cpu_parallel_threads, py::arg("n"), nogil);
  py::dict info;
  info["openmp"] =
#ifdef _OPENMP
      true;
#else
      false;
#endif
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
