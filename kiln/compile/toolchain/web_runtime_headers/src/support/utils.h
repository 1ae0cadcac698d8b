// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (for Kiln's web and mobile runtime builds).
#ifndef TVM_SUPPORT_UTILS_H_
#define TVM_SUPPORT_UTILS_H_

#include <string>

namespace tvm {
namespace support {

inline bool StartsWith(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}
// The thread pool's TVM_BIND_THREADS parsing (native runtimes only).
inline bool IsNumber(const std::string& text) {
  return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
}

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_UTILS_H_
