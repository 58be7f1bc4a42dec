// Python bindings of the mobiuspipe C++ extension (mobiuspipe._C).
#include <torch/extension.h>
#include <torch/version.h>

#include "adam/cpu_adam.h"
#include "io/async_io.h"
#include "io/crc32c.h"

namespace {

uint32_t crc32c_tensor(torch::Tensor t, int64_t prev, bool reference) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "crc32c needs a contiguous CPU tensor");
  const void* p = t.data_ptr();
  const size_t n = static_cast<size_t>(t.numel() * t.element_size());
  py::gil_scoped_release nogil;
  const uint32_t seed = static_cast<uint32_t>(prev);
  return reference ? mobiuspipe::crc32c_table(seed, p, n) : mobiuspipe::crc32c(seed, p, n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using mobiuspipe::AsyncIO;
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.doc() = "mobiuspipe native ops: SIMD CPU AdamW, asynchronous O_DIRECT file I/O, CRC-32C";
  m.def("simd_paths", &mobiuspipe::simd_paths, "SIMD paths this CPU supports, best first");
  m.def("resolve_simd", &mobiuspipe::resolve_simd, "the path 'auto' or a name resolves to", py::arg("simd"));
  m.def("adamw_step", &mobiuspipe::adamw_step, "one AdamW step in place (torch.optim.AdamW semantics)",
        py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("out"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("simd") = "auto", nogil());
  m.def("copy_floor", &mobiuspipe::copy_floor, "memory-traffic floor of adamw_step (no arithmetic)", py::arg("param"),
        py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("out"), nogil());
  m.def("crc32c", &crc32c_tensor, "CRC-32C of a tensor's bytes, continuing `prev`", py::arg("t"), py::arg("prev") = 0,
        py::arg("reference") = false);
  m.def("crc32c_combine", &mobiuspipe::crc32c_combine, "CRC-32C of A + B from those of A and B and len(B)",
        py::arg("crc1"), py::arg("crc2"), py::arg("len2"));
  m.def("crc32c_has_hw", &mobiuspipe::crc32c_has_hw, "whether the SSE4.2 crc32 instruction is used");
  m.attr("TORCH_VERSION") = py::make_tuple(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
  m.attr("IO_ALIGN") = mobiuspipe::kAlign;
  m.attr("IO_SHORT_READ") = mobiuspipe::kShortRead;
  m.attr("IO_SHORT_WRITE") = mobiuspipe::kShortWrite;
  py::class_<AsyncIO>(m, "AsyncIO", "asynchronous tensor reads/writes at file offsets (io_uring or threads)")
      .def(py::init<const std::string&, int64_t, int64_t>(), py::arg("backend") = "auto", py::arg("queue_depth") = 32,
           py::arg("block_bytes") = 1 << 20)
      .def_property_readonly("backend", &AsyncIO::backend)
      .def_property_readonly("fallback_reason", &AsyncIO::fallback_reason)
      .def_property_readonly("queue_depth", &AsyncIO::queue_depth)
      .def_property_readonly("block_bytes", &AsyncIO::block_bytes)
      .def("submit", &AsyncIO::submit, py::arg("fd"), py::arg("t"), py::arg("offset"), py::arg("write"),
           py::arg("direct"), py::arg("checksum") = false)
      .def("wait", &AsyncIO::wait, py::arg("ticket"), nogil())
      .def("done", &AsyncIO::done, py::arg("ticket"))
      .def("pending", &AsyncIO::pending)
      .def("register_buffers", &AsyncIO::register_buffers, py::arg("buffers"))
      .def_property_readonly("registered", &AsyncIO::registered)
      .def("inject_fault", &AsyncIO::inject_fault, py::arg("nth"), py::arg("err") = 0, py::arg("short_bytes") = 0);
}
