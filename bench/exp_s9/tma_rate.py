"""Session 9: is decode's per-CTA read rate (about 55 GB/s per CTA at any CTA count, s9d) the cp.async
path's or the kernel's? Two bare streaming kernels, one CTA per SM (128 threads, no compute), a ring of ST
stages of 64 KB (a d=128 n128 K+V block), one __syncthreads per block as decode's loop:
  cpasync   16-byte cp.async.cg per thread (32 per thread per block), wait_group, __syncthreads
  tma       thread 0 issues four 16 KB TMA boxes (64 columns x 128 rows, 128-byte swizzle) per block
            on the stage's mbarrier; every thread waits on it, __syncthreads, refill
Per-CTA rate at 8..64 CTAs (HBM never limits) and the aggregate at 128 and 132.

    python3 bench/exp_s9/tma_rate.py OUT.json
"""
import ctypes
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from flashgen import tma  # noqa: E402

T = ROOT / "flashgen" / "templates"
HEAD = (T / "common.cuh").read_text() + (T / "hopper.cuh").read_text()
SRC = HEAD + r"""
template <int ST, bool TMA>
__device__ void body(const fg_tmap* map, const uint4* buf, int blocks, int* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const fg_u32 base = (smem_addr(smem) + 1023) & ~1023u;
  const fg_u32 bars = base + ST * 65536;
  const int c = blockIdx.x, tid = threadIdx.x;
  const long long row0 = (long long)c * blocks * 512;  // 512 rows of 128 B per 64 KB block
  auto issue = [&](int j) {
    const int s = j % ST;
    if (j >= blocks) { if (!TMA) cp_async_commit(); return; }
    if constexpr (TMA) {
      if (tid == 0) {
        mbar_expect_tx(bars + 8 * s, 65536);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          tma_load_4d(base + s * 65536 + q * 16384, map, bars + 8 * s, 0, (int)(row0 + j * 512 + q * 128), 0, 0);
      }
    } else {
      const uint4* src = buf + (row0 + (long long)j * 512) * 8;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int e = i * 128 + tid;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(base + s * 65536 + e * 16), "l"(src + e));
      }
      cp_async_commit();
    }
  };
  if (TMA && tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(bars + 8 * s, 1);
    mbar_init_fence();
  }
  __syncthreads();
  for (int j = 0; j < ST - 1; ++j) issue(j);
  int acc = 0;
  for (int j = 0; j < blocks; ++j) {
    if constexpr (TMA) {
      mbar_wait(bars + 8 * (j % ST), (j / ST) & 1);
    } else {
      cp_async_wait<ST - 2>();
    }
    __syncthreads();
    issue(j + ST - 1);
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(base + (j % ST) * 65536 + tid * 512));
    acc ^= v;
  }
  if (acc == 0x7fffffff) sink[c] = acc;
}
extern "C" __global__ void __launch_bounds__(128) tma3(const __grid_constant__ fg_tmap map, const uint4* buf, int blocks, int* sink) { body<3, true>(&map, buf, blocks, sink); }
extern "C" __global__ void __launch_bounds__(128) tma2(const __grid_constant__ fg_tmap map, const uint4* buf, int blocks, int* sink) { body<2, true>(&map, buf, blocks, sink); }
extern "C" __global__ void __launch_bounds__(128) cpa3(const __grid_constant__ fg_tmap map, const uint4* buf, int blocks, int* sink) { body<3, false>(&map, buf, blocks, sink); }
extern "C" __global__ void __launch_bounds__(128) cpa2(const __grid_constant__ fg_tmap map, const uint4* buf, int blocks, int* sink) { body<2, false>(&map, buf, blocks, sink); }
"""


def main(out):
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    total_blocks = 132 * 520  # 64 KB blocks: about 4.5 GB
    buf = cp.random.randint(0, 2 ** 31, size=total_blocks * 65536 // 4, dtype=cp.int32)
    rows = total_blocks * 512
    dims, strides = [64, rows, 1, 1], [128, rows * 128, rows * 128]
    raw = tma.encode(buf.data.ptr, "bf16", dims, strides, [64, 128, 1, 1])
    mp = _Map(raw)
    sink = cp.zeros(256, dtype=cp.int32)
    res = {}
    for name in ("cpa2", "cpa3", "tma2", "tma3"):
        k = mod.get_function(name)
        st = int(name[-1])
        smem = st * 65536 + 1024 + 64
        k.max_dynamic_shared_size_bytes = smem
        for ctas in (8, 16, 32, 64, 128, 132):
            blocks = total_blocks // max(ctas, 132) if ctas >= 128 else 256
            ts = []
            for rep in range(12):
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record()
                launch(k, ctas, smem, mp, buf, blocks, sink)
                e.record()
                e.synchronize()
                if rep >= 2:
                    ts.append(cp.cuda.get_elapsed_time(s, e) * 1e3)
            us = float(np.median(ts))
            nbytes = ctas * blocks * 65536
            res[f"{name}_{ctas}"] = {"us": us, "tbps": nbytes / us / 1e6, "gbps_per_cta": nbytes / us / 1e3 / ctas}
            print(f"{name} ctas {ctas:3d}: {nbytes / us / 1e6:.3f} TB/s, {nbytes / us / 1e3 / ctas:6.1f} GB/s per CTA", flush=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


class _Map:
    """128 bytes of a CUtensorMap, passed by value (the driver copies kernel arguments from these addresses)."""
    def __init__(self, raw):
        self.c = (ctypes.c_uint64 * 16).from_buffer_copy(raw)


def launch(k, ctas, smem, mp, buf, blocks, sink):
    from cupy_backends.cuda.api import driver

    b, n, o = ctypes.c_void_p(buf.data.ptr), ctypes.c_int(blocks), ctypes.c_void_p(sink.data.ptr)
    argv = (ctypes.c_void_p * 4)(ctypes.addressof(mp.c), ctypes.addressof(b), ctypes.addressof(n), ctypes.addressof(o))
    driver.launchKernel(k.kernel.ptr, ctas, 1, 1, 128, 1, 1, smem, 0, ctypes.addressof(argv), 0)


if __name__ == "__main__":
    main(sys.argv[1])
