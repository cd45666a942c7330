// 2^x on the FMA pipe (the idea of FlashAttention-4): MUFU.EX2 does 16 per clock per SM on Hopper, so
// at d = 64 the softmax's exp2s take as long as the two GEMMs. Computing some of them with FADD/FFMA
// and one integer op lets the FMA pipe (128 per clock per SM) take a share of that work.
//
//   x = n + f, n = floor(x), f in [0, 1): the add of 1.5 * 2^23 rounded toward -inf leaves
//     t = 1.5 * 2^23 + n (exact for |x| < 2^22), so n = t - 1.5 * 2^23 and f = x - n, both exact;
//   2^f ~ p(f) = 1 + f (C1 + f (C2 + f C3)): minimax in relative error on [0, 1) with p(0) = 1 fixed
//     (so 2^n is exact at integers), by the Remez exchange (tests/test_exp2_fma.py derives and
//     checks it): max relative error 8.559e-5 in exact arithmetic, 8.565e-5 with these fp32
//     coefficients evaluated in fp32. P is rounded to bf16/fp16 (half-ulp 2e-3/4.9e-4) after this;
//   2^x = p with n added to its exponent field: the bits of p plus t << 23 (the low 9 bits of t's
//     bit pattern are n, two's complement, for n in [-256, 255]).
// x is clamped to >= -127 first: x = -inf (a masked score) gives n = -127, f = 0, p = 1.0 exactly
// (0x3F800000) and the sum of the bits is 0, i.e. exactly +0 with no NaN; x in (-127, -126) gives a
// subnormal-pattern value below 2^-126. Valid for x <= 127; the softmax passes x <= 8.
#pragma once

#define FG_EXP2_C1 0x1.63e658p-1f
#define FG_EXP2_C2 0x1.d2378ap-3f
#define FG_EXP2_C3 0x1.3baaa6p-4f

FG_DEVICE float exp2_fma(float x) {
  x = fmaxf(x, -127.f);
  float t;
  asm("add.rm.f32 %0, %1, 0f4B400000;\n" : "=f"(t) : "f"(x));  // 1.5 * 2^23 + floor(x)
  const float f = x - (t - 12582912.f);
  const float p = fmaf(fmaf(fmaf(FG_EXP2_C3, f, FG_EXP2_C2), f, FG_EXP2_C1), f, 1.f);
  return __int_as_float(__float_as_int(p) + static_cast<int>(static_cast<unsigned>(__float_as_int(t)) << 23));
}
