// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef TVM_SUPPORT_BYTES_IO_H_
#define TVM_SUPPORT_BYTES_IO_H_

#include <tvm/ffi/error.h>
#include <tvm/ffi/string.h>
#include <tvm/support/io.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

/*! \brief Reads from bytes owned by the caller, who keeps them alive while the stream is used. */
class BytesInStream : public Stream {
 public:
  explicit BytesInStream(const std::string& bytes) : data_(bytes.data()), size_(bytes.size()) {}
  explicit BytesInStream(const ffi::Bytes& bytes) : data_(bytes.data()), size_(bytes.size()) {}

  using Stream::Read;
  using Stream::Write;

  size_t Read(void* data, size_t size) final {
    size_t count = std::min(size, size_ - position_);
    if (count != 0) std::memcpy(data, data_ + position_, count);
    position_ += count;
    return count;
  }
  size_t Write(const void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "BytesInStream is read-only";
    TVM_FFI_UNREACHABLE();
  }

 private:
  const char* data_;
  size_t size_;
  size_t position_ = 0;
};

/*! \brief Appends everything written to a caller-owned string. */
class BytesOutStream : public Stream {
 public:
  explicit BytesOutStream(std::string* out) : out_(out) {}

  using Stream::Read;
  using Stream::Write;

  size_t Write(const void* data, size_t size) final {
    out_->append(static_cast<const char*>(data), size);
    return size;
  }
  size_t Read(void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "BytesOutStream is write-only";
    TVM_FFI_UNREACHABLE();
  }

 private:
  std::string* out_;
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_BYTES_IO_H_
