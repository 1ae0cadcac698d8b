// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
// NVTX marks profiler ranges on CUDA; the web runtime has no profiler to tell, so a range is a no-op.
#ifndef TVM_SUPPORT_CUDA_NVTX_H_
#define TVM_SUPPORT_CUDA_NVTX_H_

#include <string>

namespace tvm {
namespace support {

class NVTXScopedRange {
 public:
  explicit NVTXScopedRange(const std::string& /*name*/) {}
  NVTXScopedRange(const NVTXScopedRange&) = delete;
  NVTXScopedRange& operator=(const NVTXScopedRange&) = delete;
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_CUDA_NVTX_H_
