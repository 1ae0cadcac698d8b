// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef TVM_SUPPORT_UTILS_H_
#define TVM_SUPPORT_UTILS_H_

#include <string>

namespace tvm {
namespace support {

inline bool StartsWith(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_UTILS_H_
