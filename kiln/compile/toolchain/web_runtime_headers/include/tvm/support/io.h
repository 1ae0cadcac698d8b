// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef TVM_SUPPORT_IO_H_
#define TVM_SUPPORT_IO_H_

#include <cstddef>

namespace tvm {
namespace support {

template <typename T>
struct Serializer;

/*! \brief A byte stream; typed values go through Serializer<T> (see serializer.h). */
class Stream {
 public:
  virtual ~Stream() = default;
  /*! \return the number of bytes actually read (less than size at the end of the stream) */
  virtual size_t Read(void* data, size_t size) = 0;
  virtual size_t Write(const void* data, size_t size) = 0;

  template <typename T>
  void Write(const T& value) {
    Serializer<T>::Write(this, value);
  }
  template <typename T>
  bool Read(T* value) {
    return Serializer<T>::Read(this, value);
  }
  template <typename T>
  void WriteArray(const T* values, size_t count) {
    for (size_t i = 0; i < count; ++i) Write(values[i]);
  }
  template <typename T>
  bool ReadArray(T* values, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      if (!Read(values + i)) return false;
    }
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#include <tvm/support/serializer.h>

#endif  // TVM_SUPPORT_IO_H_
