// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef TVM_SUPPORT_ARENA_H_
#define TVM_SUPPORT_ARENA_H_

#include <cstddef>
#include <memory>
#include <type_traits>
#include <vector>

namespace tvm {
namespace support {

/*! \brief Scratch memory for trivial objects, all released together by RecycleAll(). */
class Arena {
 public:
  template <typename T>
  T* allocate_(int count) {
    static_assert(std::is_trivial_v<T>, "Arena only holds trivial objects");
    size_t units = (sizeof(T) * count + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
    blocks_.push_back(std::make_unique<std::max_align_t[]>(units == 0 ? 1 : units));
    return reinterpret_cast<T*>(blocks_.back().get());
  }

  void RecycleAll() { blocks_.clear(); }

 private:
  std::vector<std::unique_ptr<std::max_align_t[]>> blocks_;
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_ARENA_H_
