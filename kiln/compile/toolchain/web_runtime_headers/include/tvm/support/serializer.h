// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
//
// Byte layout (it must match what the TVM compiler writes into a model library):
// plain values are their little-endian bytes; strings and sequences are a uint64
// count followed by the elements; maps are a uint64 count followed by key, value pairs;
// classes with Save(Stream*) / Load(Stream*) members write themselves.
#ifndef TVM_SUPPORT_SERIALIZER_H_
#define TVM_SUPPORT_SERIALIZER_H_

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/endian.h>
#include <tvm/ffi/string.h>
#include <tvm/support/io.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

static_assert(TVM_FFI_IO_NO_ENDIAN_SWAP, "Kiln's serializer only supports little-endian hosts");

namespace tvm {
namespace support {

/*! \brief Plain values (numbers, enums, C structs such as DLDataType) or classes with Save/Load. */
template <typename T>
struct Serializer {
  static void Write(Stream* strm, const T& value) {
    if constexpr (std::is_trivially_copyable_v<T>) {
      strm->Write(&value, sizeof(T));
    } else {
      value.Save(strm);
    }
  }
  static bool Read(Stream* strm, T* value) {
    if constexpr (std::is_trivially_copyable_v<T>) {
      return strm->Read(value, sizeof(T)) == sizeof(T);
    } else {
      return value->Load(strm);
    }
  }
};

namespace detail {

inline void WriteBytes(Stream* strm, const char* data, size_t size) {
  strm->Write(static_cast<uint64_t>(size));
  if (size != 0) strm->Write(data, size);
}

inline bool ReadBytes(Stream* strm, std::string* out) {
  uint64_t size;
  if (!strm->Read(&size)) return false;
  out->resize(size);
  return size == 0 || strm->Read(out->data(), size) == size;
}

}  // namespace detail

template <>
struct Serializer<std::string> {
  static void Write(Stream* strm, const std::string& value) {
    detail::WriteBytes(strm, value.data(), value.size());
  }
  static bool Read(Stream* strm, std::string* value) { return detail::ReadBytes(strm, value); }
};

template <>
struct Serializer<ffi::String> {
  static void Write(Stream* strm, const ffi::String& value) {
    detail::WriteBytes(strm, value.data(), value.size());
  }
  static bool Read(Stream* strm, ffi::String* value) {
    std::string bytes;
    if (!detail::ReadBytes(strm, &bytes)) return false;
    *value = ffi::String(std::move(bytes));
    return true;
  }
};

template <typename T>
struct Serializer<std::vector<T>> {
  static void Write(Stream* strm, const std::vector<T>& values) {
    strm->Write(static_cast<uint64_t>(values.size()));
    strm->WriteArray(values.data(), values.size());
  }
  static bool Read(Stream* strm, std::vector<T>* values) {
    uint64_t size;
    if (!strm->Read(&size)) return false;
    values->resize(size);
    return strm->ReadArray(values->data(), size);
  }
};

template <typename T>
struct Serializer<ffi::Array<T>> {
  static void Write(Stream* strm, const ffi::Array<T>& values) {
    strm->Write(static_cast<uint64_t>(values.size()));
    for (const T& value : values) strm->Write(value);
  }
  static bool Read(Stream* strm, ffi::Array<T>* values) {
    uint64_t size;
    if (!strm->Read(&size)) return false;
    ffi::Array<T> result;
    for (uint64_t i = 0; i < size; ++i) {
      T value;
      if (!strm->Read(&value)) return false;
      result.push_back(std::move(value));
    }
    *values = std::move(result);
    return true;
  }
};

template <typename K, typename V>
struct Serializer<std::unordered_map<K, V>> {
  static void Write(Stream* strm, const std::unordered_map<K, V>& map) {
    strm->Write(static_cast<uint64_t>(map.size()));
    for (const auto& [key, value] : map) {
      strm->Write(key);
      strm->Write(value);
    }
  }
  static bool Read(Stream* strm, std::unordered_map<K, V>* map) {
    uint64_t size;
    if (!strm->Read(&size)) return false;
    map->clear();
    for (uint64_t i = 0; i < size; ++i) {
      K key;
      V value;
      if (!strm->Read(&key) || !strm->Read(&value)) return false;
      map->emplace(std::move(key), std::move(value));
    }
    return true;
  }
};

template <typename K, typename V>
struct Serializer<ffi::Map<K, V>> {
  static void Write(Stream* strm, const ffi::Map<K, V>& map) {
    strm->Write(static_cast<uint64_t>(map.size()));
    for (const auto& [key, value] : map) {
      strm->Write(key);
      strm->Write(value);
    }
  }
  static bool Read(Stream* strm, ffi::Map<K, V>* map) {
    uint64_t size;
    if (!strm->Read(&size)) return false;
    ffi::Map<K, V> result;
    for (uint64_t i = 0; i < size; ++i) {
      K key;
      V value;
      if (!strm->Read(&key) || !strm->Read(&value)) return false;
      result.Set(key, value);
    }
    *map = std::move(result);
    return true;
  }
};

}  // namespace support
}  // namespace tvm

#endif  // TVM_SUPPORT_SERIALIZER_H_
