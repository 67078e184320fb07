// Placeholder native module: proves the build runs. The FFI bridge issue replaces it.
#include <nanobind/nanobind.h>
NB_MODULE(_jbg_ffi, m) { m.attr("ABI_VERSION") = 0; }
