// An FP8 (float8 e4m3) KV cache in decode_split: the conversions between e4m3 and the query's 16-bit
// type (decode_split.cuh's FP8 switch uses them; a 16-bit cache never does).
//
// Widening, in the block loop. ldmatrix hands a thread four e4m3 values per register (one per byte);
// e4m3x4_widen makes two registers of two 16-bit values, bytes 0 and 2 ("even") and bytes 1 and 3
// ("odd"): the pairs the mma's B fragments take (decode_split.cuh: from K, one key's columns 4t..4t+3,
// Q's fragments permuted to match; from V, transposed, columns 2g and 2g+1 of keys 2t and 2t+1). The
// e4m3 bit fields are moved into the 16-bit format -- the sign to bit 15, exponent and mantissa just
// below the wider exponent field's top -- which reads as the value times 2^-120 (bf16) or 2^-8 (fp16),
// e4m3's subnormals included (they land on the wider format's subnormals with the same scale), and one
// exact multiply by the power of two restores the value. Per register of two values: a byte permute,
// a shift, a mask (integer pipe) and a half-precision multiply, on every arch (no e4m3 conversion
// instruction needed, sm_80 included).
//
// Narrowing, for the append of k_new / v_new: round-to-nearest-even e4m3 of x / descale, saturating
// at +-448: torch's (x / descale).clamp(-448, 448).to(torch.float8_e4m3fn) bit for bit
// (flashgen.families.decode.e4m3_from_float mirrors it on the host).
#pragma once

// The cache's element type: 16-bit (elem_t) or e4m3 bytes.
template <bool FP8>
struct kv_elem { typedef elem_t type; };
template <>
struct kv_elem<true> { typedef unsigned char type; };

FG_DEVICE fg_u32 byte_perm(fg_u32 a, fg_u32 b, fg_u32 sel) {
  fg_u32 r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// x * y on two 16-bit lanes, round to nearest (exact here: y is a power of two and the results are
// normal or the same subnormals scaled). bf16 as an fma with -0 (mul.bf16x2 needs sm_90).
template <bool BF16>
FG_DEVICE fg_u32 mul2(fg_u32 x, fg_u32 y) {
  fg_u32 r;
  if constexpr (BF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(x), "r"(y), "r"(0x80008000u));
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(y));
  }
  return r;
}

// One 16-bit lane pair of sign-replicated bytes (prmt's sign mode puts copies of each byte's sign bit
// above it) as the 16-bit values of those e4m3 bytes. bf16: shift 4 (exponent and mantissa to bits
// 10..4, a sign copy to bit 15), keep bits 15 and 10..4, times 2^120 (0x7B80); fp16: shift 7 (to bits
// 13..7), keep 15 and 13..7, times 2^8 (0x5C00). What a lane shifts into its neighbour is masked off.
template <bool BF16>
FG_DEVICE fg_u32 e4m3x2_widen_signed(fg_u32 s) {
  if constexpr (BF16) return mul2<true>((s << 4) & 0x87F087F0u, 0x7B807B80u);
  return mul2<false>((s << 7) & 0xBF80BF80u, 0x5C005C00u);
}

// Four e4m3 values (bytes 0..3 of x) as 16-bit pairs: even = (byte 0, byte 2), odd = (byte 1, byte 3),
// the first of each pair in the low half. Exact.
template <bool BF16>
FG_DEVICE void e4m3x4_widen(fg_u32 x, fg_u32& even, fg_u32& odd) {
  even = e4m3x2_widen_signed<BF16>(byte_perm(x, 0u, 0xA280u));  // bytes 0, sign(0), 2, sign(2)
  odd = e4m3x2_widen_signed<BF16>(byte_perm(x, 0u, 0xB391u));   // bytes 1, sign(1), 3, sign(3)
}

// The e4m3 byte of x: round to nearest even, saturating at +-448 (e4m3fn's largest finite value); NaN
// stays NaN. Below 2^-6 the values are the subnormal steps of 2^-9 (8 steps is 2^-6, the smallest
// normal, whose byte is 8 too); above, the fp32 exponent is rebiased (127 -> 7) and the mantissa
// rounded from 23 bits to 3, a carry moving into the exponent.
FG_DEVICE fg_u32 e4m3_from_float(float x) {
  const fg_u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  if (x != x) return sign | 0x7Fu;
  const float a = fminf(fabsf(x), 448.f);
  if (a < 0.015625f) return sign | static_cast<fg_u32>(__float2int_rn(a * 512.f));
  const fg_u32 v = __float_as_uint(a) - (120u << 23);
  return sign | ((v + 0x7FFFFu + ((v >> 20) & 1u)) >> 20);
}

// A 16-bit value as fp32 (exact).
template <bool BF16>
FG_DEVICE float widen16(fg_u32 h) {
  if constexpr (BF16) return __uint_as_float(h << 16);
  float f;
  asm("{\n .reg .b16 h;\n cvt.u16.u32 h, %1;\n cvt.f32.f16 %0, h;\n}\n" : "=f"(f) : "r"(h));
  return f;
}

// Eight 16-bit values (16 bytes) as eight e4m3 bytes of x / descale, in order. A rolled loop (selects,
// not an indexed array): the exact division's code once, not eight times in every caller's copy.
template <bool BF16>
FG_DEVICE uint2 e4m3x8_quantize(const fg_u32x4 x, float descale) {
  fg_u32 lo = 0u, hi = 0u;
#pragma unroll 1
  for (int i = 0; i < 8; ++i) {
    const fg_u32 w = i < 2 ? x.x : i < 4 ? x.y : i < 6 ? x.z : x.w;
    const fg_u32 byte = e4m3_from_float(__fdiv_rn(widen16<BF16>((w >> (16 * (i & 1))) & 0xFFFFu), descale));
    if (i < 4) {
      lo |= byte << (8 * i);
    } else {
      hi |= byte << (8 * (i - 4));
    }
  }
  return make_uint2(lo, hi);
}
