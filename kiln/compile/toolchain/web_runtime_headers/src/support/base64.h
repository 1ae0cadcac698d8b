// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
// Standard base64 (RFC 4648, '=' padding) layered over another Stream; tensors use it to embed in JSON.
#ifndef TVM_SUPPORT_BASE64_H_
#define TVM_SUPPORT_BASE64_H_

#include <tvm/ffi/error.h>
#include <tvm/support/io.h>

#include <cctype>
#include <cstdint>
#include <string>

namespace tvm {
namespace support {

namespace base64 {

inline const char* Alphabet() {
  return "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
}

/*! \return the 6-bit value of a base64 character, or -1 for anything else (padding included) */
inline int Decode(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

}  // namespace base64

/*! \brief Encodes what is written to it; call Finish() to flush the last group and padding. */
class Base64OutStream : public Stream {
 public:
  explicit Base64OutStream(Stream* out) : out_(out) {}

  using Stream::Read;
  using Stream::Write;

  size_t Write(const void* data, size_t size) final {
    const uint8_t* bytes = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < size; ++i) {
      group_[group_size_++] = bytes[i];
      if (group_size_ == 3) EmitGroup();
    }
    return size;
  }
  size_t Read(void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "Base64OutStream is write-only";
    TVM_FFI_UNREACHABLE();
  }

  void Finish() {
    if (group_size_ != 0) EmitGroup();
  }

 private:
  void EmitGroup() {
    const char* alphabet = base64::Alphabet();
    uint32_t bits = (group_[0] << 16) | (group_size_ > 1 ? group_[1] << 8 : 0) |
                    (group_size_ > 2 ? group_[2] : 0);
    char text[4] = {alphabet[(bits >> 18) & 63], alphabet[(bits >> 12) & 63],
                    group_size_ > 1 ? alphabet[(bits >> 6) & 63] : '=',
                    group_size_ > 2 ? alphabet[bits & 63] : '='};
    out_->Write(text, 4);
    group_size_ = 0;
  }

  Stream* out_;
  uint8_t group_[3];
  int group_size_ = 0;
};

/*! \brief Decodes base64 text read from another stream; whitespace between characters is skipped. */
class Base64InStream : public Stream {
 public:
  explicit Base64InStream(Stream* in) : in_(in) {}

  using Stream::Read;
  using Stream::Write;

  /*! \brief Kept for the callers' protocol: decoding starts at the first base64 character. */
  void InitPosition() {}

  size_t Read(void* data, size_t size) final {
    uint8_t* out = static_cast<uint8_t*>(data);
    size_t count = 0;
    while (count < size) {
      if (decoded_position_ == decoded_size_ && !DecodeGroup()) break;
      out[count++] = decoded_[decoded_position_++];
    }
    return count;
  }
  size_t Write(const void*, size_t) final {
    TVM_FFI_THROW(InternalError) << "Base64InStream is read-only";
    TVM_FFI_UNREACHABLE();
  }

 private:
  /*! \return false at the end of the text or after padding */
  bool DecodeGroup() {
    if (finished_) return false;
    char text[4];
    for (int i = 0; i < 4; ++i) {
      if (!NextCharacter(&text[i])) {
        TVM_FFI_ICHECK_EQ(i, 0) << "base64 text ends inside a group";
        finished_ = true;
        return false;
      }
    }
    int values[4];
    for (int i = 0; i < 4; ++i) values[i] = base64::Decode(text[i]);
    TVM_FFI_ICHECK(values[0] >= 0 && values[1] >= 0) << "invalid base64 text";
    uint32_t bits = (values[0] << 18) | (values[1] << 12) | (values[2] >= 0 ? values[2] << 6 : 0) |
                    (values[3] >= 0 ? values[3] : 0);
    decoded_[0] = static_cast<uint8_t>(bits >> 16);
    decoded_[1] = static_cast<uint8_t>(bits >> 8);
    decoded_[2] = static_cast<uint8_t>(bits);
    decoded_size_ = values[2] < 0 ? 1 : (values[3] < 0 ? 2 : 3);
    decoded_position_ = 0;
    if (decoded_size_ < 3) finished_ = true;
    return true;
  }

  bool NextCharacter(char* c) {
    do {
      if (in_->Read(c, 1) != 1) return false;
    } while (std::isspace(static_cast<unsigned char>(*c)));
    return true;
  }

  Stream* in_;
  uint8_t decoded_[3];
  int decoded_size_ = 0;
  int decoded_position_ = 0;
  bool finished_ = false;
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_BASE64_H_
