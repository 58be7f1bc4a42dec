// Python bindings of the mobiuspipe C++ extension (mobiuspipe._C).
#include <torch/extension.h>
#include "adam/cpu_adam.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mobiuspipe native ops: SIMD CPU AdamW";
  m.def("simd_paths", &mobiuspipe::simd_paths, "SIMD paths this CPU supports, best first");
  m.def("resolve_simd", &mobiuspipe::resolve_simd, "the path 'auto' or a name resolves to", py::arg("simd"));
  m.def("adamw_step", &mobiuspipe::adamw_step, "one AdamW step in place (torch.optim.AdamW semantics)",
        py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("out"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("simd") = "auto");
  m.def("copy_floor", &mobiuspipe::copy_floor, "memory-traffic floor of adamw_step (no arithmetic)",
        py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"), py::arg("out"));
}
