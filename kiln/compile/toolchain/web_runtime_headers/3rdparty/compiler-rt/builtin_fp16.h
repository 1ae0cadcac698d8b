// Kiln's minimal stand-in for a TVM header that the apache-tvm wheel omits (written for Kiln's web runtime build).
#ifndef KILN_BUILTIN_FP16_H_
#define KILN_BUILTIN_FP16_H_

#include <cstdint>
#include <cstring>

/*!
 * \brief Widen an IEEE-754 binary float (e.g. half, stored as uint16_t) to a wider one.
 * The Rep types are unsigned integers of each format's width; SigBits count the stored
 * significand bits (10 for half, 23 for float). Every value, subnormals, infinities and
 * NaN payloads included, is exact because the destination is wider in both fields.
 */
template <typename SrcT, typename SrcRepT, int SrcSigBits, typename DstT, typename DstRepT,
          int DstSigBits>
inline DstT __extendXfYf2__(SrcT value) {
  constexpr int kSrcBits = sizeof(SrcRepT) * 8;
  constexpr int kSrcExpMax = (1 << (kSrcBits - SrcSigBits - 1)) - 1;
  constexpr int kSrcBias = kSrcExpMax >> 1;
  constexpr int kDstBits = sizeof(DstRepT) * 8;
  constexpr int kDstExpMax = (1 << (kDstBits - DstSigBits - 1)) - 1;
  constexpr int kDstBias = kDstExpMax >> 1;
  constexpr DstRepT kDstImplicitBit = DstRepT(1) << DstSigBits;

  SrcRepT src;
  std::memcpy(&src, &value, sizeof(src));
  DstRepT sign = DstRepT(src >> (kSrcBits - 1)) << (kDstBits - 1);
  int exponent = static_cast<int>(src >> SrcSigBits) & kSrcExpMax;
  DstRepT significand = DstRepT(src & ((SrcRepT(1) << SrcSigBits) - 1)) << (DstSigBits - SrcSigBits);

  DstRepT dst;
  if (exponent == kSrcExpMax) {  // infinity or NaN
    dst = sign | (DstRepT(kDstExpMax) << DstSigBits) | significand;
  } else if (exponent != 0) {
    dst = sign | (DstRepT(exponent - kSrcBias + kDstBias) << DstSigBits) | significand;
  } else if (significand == 0) {
    dst = sign;
  } else {  // a source subnormal is a normal number in the wider format
    int shift = 0;
    while (!(significand & kDstImplicitBit)) {
      significand <<= 1;
      ++shift;
    }
    dst = sign | (DstRepT(1 - kSrcBias - shift + kDstBias) << DstSigBits) |
          (significand & ~kDstImplicitBit);
  }
  DstT result;
  std::memcpy(&result, &dst, sizeof(result));
  return result;
}

#endif  // KILN_BUILTIN_FP16_H_
