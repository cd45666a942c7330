// What a kernel's user mods read (flashgen/mods.py prints them as fg_score_mod and fg_mask_mod from a
// traced expression graph; templates/common/mod.cuh calls them): up to four captured tensors, each as
// its address, element strides and sizes over up to four dimensions (unused ones: stride 0, size 1).
// Every index a mod reads with is clamped into its dimension (fg_clampi): an index outside the tensor
// reads the nearest element instead of faulting. The block is part of every fwd_sm90 parameter block
// (all zero where the kernel has no mods).
#pragma once

struct fg_mod_args {
  const void* t[4];
  long long s[4][4];
  int n[4][4];
};

FG_DEVICE int fg_clampi(int x, int n) { return min(max(x, 0), n - 1); }
// Half-precision captures without CUDA's headers (NVRTC finds none): fp16 through cvt, bf16 as the top
// half of an fp32.
FG_DEVICE float fg_half_to_float(unsigned short x) {
  float f;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }\n" : "=f"(f) : "h"(x));
  return f;
}
FG_DEVICE float fg_bf16_to_float(unsigned short x) { return __uint_as_float(static_cast<unsigned>(x) << 16); }

// The hardware's approximations the printed mods use for / and the float functions (flashgen/mods/graph.py:
// the exact forms are instruction sequences; these are one MUFU issue each), beside common.cuh's
// fast_exp2 and fast_tanh.
FG_DEVICE float fg_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
FG_DEVICE float fg_lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
FG_DEVICE float fg_sqrt(float x) {
  float y;
  asm("sqrt.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
FG_DEVICE float fg_rsqrt(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
