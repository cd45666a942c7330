// Hopper (sm_90a) primitives: mbarriers, TMA tensor loads, wgmma descriptors and
// fences, named barriers, setmaxnreg. Inline PTX only (no headers); see
// KERNELS.md section 3 and the PTX ISA for the instruction semantics. The
// wgmma instructions themselves are emitted per N by the entry template
// (their operand lists are textual).
#pragma once

typedef unsigned long long fg_u64;

// A CUtensorMap: 128 opaque bytes built on the host (cuTensorMapEncodeTiled),
// passed by value inside the __grid_constant__ parameter struct.
struct __align__(64) fg_tmap { fg_u64 v[16]; };

// ---- mbarriers (shared::cta, 8 bytes each) ---------------------------------
FG_DEVICE void mbar_init(fg_u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
FG_DEVICE void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
FG_DEVICE void mbar_expect_tx(fg_u32 bar, fg_u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
FG_DEVICE void mbar_arrive(fg_u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One asynchronous arrive on `bar` once every cp.async this thread issued before it has completed;
// .noinc: the arrive counts against the barrier's expected count (mbar_init's, per thread).
FG_DEVICE void cp_async_mbar_arrive_noinc(fg_u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Spin until the phase with the given parity has completed.
FG_DEVICE void mbar_wait(fg_u32 bar, int parity) {
  fg_u32 done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// ---- TMA: one box of a 4-D tensor (d, seq, head, batch) into shared memory --
FG_DEVICE void tma_load_4d(fg_u32 dst, const fg_tmap* map, fg_u32 bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst), "l"(reinterpret_cast<fg_u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
FG_DEVICE void tma_prefetch_map(const fg_tmap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<fg_u64>(map)) : "memory");
}

// ---- 1-D bulk copies (cp.async.bulk, no tensor map) ---------------------------
// `bytes` contiguous bytes global -> shared (a multiple of 16; both addresses 16-byte aligned),
// counted against mbarrier `bar` (complete_tx). A CTA's own shared::cta address is a valid
// shared::cluster address without a cluster launch. The _hint form takes an L2 cache policy
// (createpolicy).
FG_DEVICE void bulk_g2s(fg_u32 dst, const void* src, fg_u32 bytes, fg_u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
FG_DEVICE void bulk_g2s_hint(fg_u32 dst, const void* src, fg_u32 bytes, fg_u32 bar, fg_u64 policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(policy) : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory accesses before later async-proxy ones
// (bulk copies, TMA, wgmma operand reads) of the CTA.
FG_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- wgmma ordering ---------------------------------------------------------
FG_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FG_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FG_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keep the compiler from moving accumulator reads/writes across a wgmma
// issue/wait (the registers are written asynchronously).
template <int N>
FG_DEVICE void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
FG_DEVICE void reg_fence(fg_u32 (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor (PTX ISA "matrix descriptor"): start address >> 4 in bits 0-13,
// leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45, base offset 0 (tiles are aligned
// to the swizzle's period), the swizzle mode in bits 62-63 (1: 128-byte, 2: 64-byte).
FG_DEVICE fg_u64 smem_desc(fg_u32 addr, fg_u32 lbo, fg_u32 sbo, fg_u64 mode) {
  return static_cast<fg_u64>((addr & 0x3FFFF) >> 4) | (static_cast<fg_u64>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<fg_u64>((sbo & 0x3FFFF) >> 4) << 32) | (mode << 62);
}
// 128-byte swizzle (tiles 1024-byte aligned).
FG_DEVICE fg_u64 sw128_desc(fg_u32 addr, fg_u32 lbo, fg_u32 sbo) { return smem_desc(addr, lbo, sbo, 1); }
// A K-major operand in panels of RB-byte rows (RB = 128 or 64) in the matching swizzle, as the TMA
// writes them: stride byte offset 8 rows (the swizzle's period), leading byte offset unused (16 B).
template <int RB>
FG_DEVICE fg_u64 sw_desc(fg_u32 addr) {
  static_assert(RB == 128 || RB == 64, "K-major panels of 128- or 64-byte rows");
  return smem_desc(addr, 16, 8 * RB, RB == 128 ? 1 : 2);
}

// Four fp32 values rounded to float8 e4m3 (to nearest, saturating at +-448), a in the low byte.
FG_DEVICE fg_u32 pack4_e4m3(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));  // (the first lands high)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<fg_u32>(lo) | (static_cast<fg_u32>(hi) << 16);
}

// ---- named barriers and register reallocation --------------------------------
FG_DEVICE void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
FG_DEVICE void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Scheduling pin: a shared-memory store predicated on `x < 0` (x is a sum of exp2s, never negative, and
// NaN compares false, so it never executes). ptxas keeps a following WARPGROUP.DEPBAR (wgmma.wait_group)
// after this store, and the store after everything x depends on: the wait cannot be hoisted above the
// code that computes x. `slot` is a word nothing reads.
FG_DEVICE void sched_pin(float x, fg_u32 slot) {
  if (x < 0.f) asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(slot), "f"(x) : "memory");
}
template <int R>
FG_DEVICE void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R)); }
template <int R>
FG_DEVICE void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R)); }
