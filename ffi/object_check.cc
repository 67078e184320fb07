#include "object_check.h"

#include <cstdint>
#include <cstring>

namespace jbg {
namespace {

constexpr uint16_t kRelocatable = 1;  // ET_REL
constexpr uint32_t kSymtab = 2;       // SHT_SYMTAB
constexpr uint32_t kNoBits = 8;       // SHT_NOBITS: occupies no bytes in the file
constexpr size_t kHeaderSize = 64, kSectionSize = 64, kSymbolSize = 24;
#if defined(__x86_64__)
constexpr int kHostMachine = 62;  // EM_X86_64
#elif defined(__aarch64__)
constexpr int kHostMachine = 183;  // EM_AARCH64
#else
constexpr int kHostMachine = -1;  // unknown host: the machine field is not checked
#endif

// [offset, offset + size) lies inside `total` bytes (no overflow on hostile values).
bool InRange(uint64_t offset, uint64_t size, uint64_t total) { return offset <= total && size <= total - offset; }

// Little-endian field of type T at `offset`; the caller has checked the range.
template <typename T>
T Field(std::string_view bytes, uint64_t offset) {
  T value;
  std::memcpy(&value, bytes.data() + offset, sizeof(T));
  return value;
}

// The NUL-terminated name at `offset` inside the string table [begin, end); false when it runs past the table.
bool NameAt(std::string_view bytes, uint64_t begin, uint64_t end, uint64_t offset, std::string_view* name) {
  if (offset >= end - begin) return false;
  const char* start = bytes.data() + begin + offset;
  const void* nul = std::memchr(start, '\0', end - begin - offset);
  if (nul == nullptr) return false;
  *name = std::string_view(start, static_cast<const char*>(nul) - start);
  return true;
}

}  // namespace

bool IsCIdentifier(std::string_view name) {
  if (name.empty() || (name[0] >= '0' && name[0] <= '9')) return false;
  for (char ch : name) {
    const bool ok = ch == '_' || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
    if (!ok) return false;
  }
  return true;
}

std::string CheckKernelObject(std::string_view object, std::string_view function_prefix) {
  const uint64_t size = object.size();
  const std::string what = "the kernel object for " + std::string(function_prefix) + " (" + std::to_string(size) +
                           " bytes) ";
  if (size < kHeaderSize || std::memcmp(object.data(), "\x7f" "ELF", 4) != 0) {
    return what + "is not an ELF object (a truncated or foreign blob)";
  }
  if (object[4] != 2 || object[5] != 1) return what + "is not a 64-bit little-endian ELF object";
  if (Field<uint16_t>(object, 16) != kRelocatable) return what + "is not a relocatable object (ELF type REL)";
  const int machine = Field<uint16_t>(object, 18);
  if (kHostMachine >= 0 && machine != kHostMachine) {
    return what + "is built for ELF machine " + std::to_string(machine) + ", not this host's " +
           std::to_string(kHostMachine);
  }
  const uint64_t shoff = Field<uint64_t>(object, 40);
  const uint16_t shentsize = Field<uint16_t>(object, 58), shnum = Field<uint16_t>(object, 60);
  if (shentsize != kSectionSize || shnum == 0) {
    return what + "has a malformed section header table (entry size " + std::to_string(shentsize) + ", " +
           std::to_string(shnum) + " entries)";
  }
  if (!InRange(shoff, uint64_t{shnum} * kSectionSize, size)) {
    return what + "is truncated: its section headers end past the object's last byte";
  }
  bool found = false;
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint64_t sh = shoff + uint64_t{i} * kSectionSize;
    const uint32_t type = Field<uint32_t>(object, sh + 4);
    const uint64_t offset = Field<uint64_t>(object, sh + 24), length = Field<uint64_t>(object, sh + 32);
    if (type != kNoBits && !InRange(offset, length, size)) {
      return what + "is truncated: section " + std::to_string(i) + " ends past the object's last byte";
    }
    if (type != kSymtab || found) continue;
    const uint32_t link = Field<uint32_t>(object, sh + 40);
    if (link >= shnum) return what + "has a symbol table whose string table index is out of range";
    const uint64_t strtab = shoff + uint64_t{link} * kSectionSize;
    const uint64_t str_begin = Field<uint64_t>(object, strtab + 24), str_size = Field<uint64_t>(object, strtab + 32);
    if (!InRange(str_begin, str_size, size)) return what + "is truncated: its symbol names end past its last byte";
    for (uint64_t s = 0; s + kSymbolSize <= length && !found; s += kSymbolSize) {
      const uint64_t sym = offset + s;
      std::string_view name;
      if (!NameAt(object, str_begin, str_begin + str_size, Field<uint32_t>(object, sym), &name)) {
        return what + "has a symbol whose name lies outside its string table";
      }
      const bool defined = Field<uint16_t>(object, sym + 6) != 0;  // st_shndx != SHN_UNDEF
      found = defined && name.size() > function_prefix.size() + 1 &&
              name.substr(0, function_prefix.size()) == function_prefix && name[function_prefix.size()] == '_';
    }
  }
  if (!found) return what + "exports no function named " + std::string(function_prefix);
  return "";
}

}  // namespace jbg
