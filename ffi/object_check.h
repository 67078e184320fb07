// Structural checks of a kernel object before it is handed to the CuTeDSL runtime.
//
// The runtime parses and links the bytes it is given; truncated, foreign or mislabelled bytes must never reach it.
// These checks read only inside the given bytes (every offset and size is bounds-checked before use) and need no
// GPU, so the same code is fuzzed from Python on CPU through the module's test hooks.
#ifndef JBG_FFI_OBJECT_CHECK_H_
#define JBG_FFI_OBJECT_CHECK_H_

#include <string>
#include <string_view>

namespace jbg {

// True when `name` is a non-empty C identifier ([A-Za-z_][A-Za-z0-9_]*): what an exported function can be called.
bool IsCIdentifier(std::string_view name);

// Checks that `object` is a relocatable ELF64 little-endian object for this host's machine whose section headers,
// sections and symbol names lie inside the bytes, and that it defines a symbol starting with `function_prefix_`
// (what CuTeDSL's dump_to_object exports for the prefix). Returns "" when it does, else what is wrong.
std::string CheckKernelObject(std::string_view object, std::string_view function_prefix);

}  // namespace jbg

#endif  // JBG_FFI_OBJECT_CHECK_H_
