// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef TVM_SUPPORT_RING_BUFFER_H_
#define TVM_SUPPORT_RING_BUFFER_H_

#include <tvm/ffi/error.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace tvm {
namespace support {

/*!
 * \brief A first-in first-out byte queue between the RPC endpoint and its channel.
 * Bytes live contiguously from head_ to the end of data_, so callbacks get one pointer.
 */
class RingBuffer {
 public:
  size_t bytes_available() const { return data_.size() - head_; }

  /*! \brief Make room for n unread bytes without reallocating. */
  void Reserve(size_t n) {
    Compact();
    data_.reserve(n);
  }

  void Write(const void* data, size_t size) { data_.append(static_cast<const char*>(data), size); }

  void Read(void* data, size_t size) {
    TVM_FFI_ICHECK_LE(size, bytes_available()) << "RingBuffer: reading more bytes than it holds";
    std::memcpy(data, data_.data() + head_, size);
    Consume(size);
  }

  /*!
   * \brief Hand up to max_nbytes unread bytes to fsend(const void* data, size_t size),
   * which returns how many it took.
   * \return the number of bytes taken
   */
  template <typename FSend>
  size_t ReadWithCallback(FSend fsend, size_t max_nbytes) {
    size_t size = std::min(max_nbytes, bytes_available());
    size_t sent = fsend(data_.data() + head_, size);
    TVM_FFI_ICHECK_LE(sent, size);
    Consume(sent);
    return sent;
  }

  /*!
   * \brief Let frecv(void* data, size_t size) fill up to max_nbytes bytes; it returns how many.
   * \return the number of bytes added
   */
  template <typename FRecv>
  size_t WriteWithCallback(FRecv frecv, size_t max_nbytes) {
    size_t old_size = data_.size();
    data_.resize(old_size + max_nbytes);
    size_t received = frecv(&data_[old_size], max_nbytes);
    TVM_FFI_ICHECK_LE(received, max_nbytes);
    data_.resize(old_size + received);
    return received;
  }

 private:
  void Consume(size_t size) {
    head_ += size;
    if (head_ == data_.size()) {
      data_.clear();
      head_ = 0;
    }
  }

  void Compact() {
    data_.erase(0, head_);
    head_ = 0;
  }

  std::string data_;
  size_t head_ = 0;
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_RING_BUFFER_H_
