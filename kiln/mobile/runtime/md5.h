// MD5 (RFC 1321) of a byte string, as lowercase hex: the digest tensor-cache.json gives each weight
// shard (kiln/tensor_cache.py writes it, every engine checks it before loading the shard).
#ifndef KILN_MD5_H_
#define KILN_MD5_H_

#include <string>

namespace kiln {

std::string Md5Hex(const std::string& bytes);

}  // namespace kiln

#endif  // KILN_MD5_H_
