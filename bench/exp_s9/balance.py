"""Session 9: can a one-wave read gain from balancing work between SMs?

The probe at b8/hk8/L128k (s9d) showed per-SM block-loop times in discrete levels from 670 to 935 us at
equal work (pairs of SMs alike: the chip's topology shares bandwidth unevenly), so the call ends ~55 us
after its median CTA. A plain read isolates the question: 128 (or 132) CTAs, one per SM, each streaming
1 MiB chunks of a 4 GiB buffer with 16-byte loads (8 in flight per thread, 1024 threads); chunks assigned
  static      CTA c reads chunks [c*K, (c+1)*K)   (as decode's splits: equal work, fixed)
  strided     CTA c reads chunks c, c+P, c+2P, ...  (equal work, interleaved)
  dynamic     CTA c reads chunk c, then takes the next from a global counter (work goes to whoever is free)
and per-CTA finish stamps (%globaltimer) show the spread.

    python3 bench/exp_s9/balance.py OUT.json
"""
import json
import sys

import cupy as cp
import numpy as np

SRC = r"""
extern "C" __global__ void __launch_bounds__(1024) rd(const uint4* __restrict__ buf, long long chunk_elems, int n_chunks,
                                                      int mode, int* counter, unsigned long long* stamps, uint4* sink) {
  extern __shared__ int s_next[];
  const int P = gridDim.x, c = blockIdx.x;
  uint4 acc = make_uint4(0, 0, 0, 0);
  int k = mode == 0 ? c * (n_chunks / P) : c;
  const int k_end = mode == 0 ? (c + 1) * (n_chunks / P) : n_chunks;
  int it = 0;
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (k < k_end) {
    const uint4* p = buf + (long long)k * chunk_elems;
    for (long long i = threadIdx.x; i < chunk_elems; i += 8 * 1024) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * 1024);
#pragma unroll
      for (int u = 0; u < 8; ++u) { acc.x ^= v[u].x; acc.y ^= v[u].y; acc.z ^= v[u].z; acc.w ^= v[u].w; }
    }
    ++it;
    if (mode == 1) {
      k += P;
    } else if (mode == 2) {
      if (threadIdx.x == 0) s_next[0] = atomicAdd(counter, 1) + P;
      __syncthreads();
      k = s_next[0];
      __syncthreads();
    } else {
      ++k;
    }
  }
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) { stamps[3 * c] = t0; stamps[3 * c + 1] = t1; stamps[3 * c + 2] = it; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[c] = acc;
}
"""


def main(out):
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    k = mod.get_function("rd")
    chunk_bytes = 1 << 20
    n_chunks = 4096 + 2 * 132  # about 4.3 GB, divisible enough
    buf = cp.random.randint(0, 2 ** 31, size=n_chunks * chunk_bytes // 4, dtype=cp.int32)
    sink = cp.zeros(4 * 256, dtype=cp.uint32)
    counter = cp.zeros(1, dtype=cp.int32)
    stamps = cp.zeros(3 * 256, dtype=cp.uint64)
    smem = 150 * 1024  # one CTA per SM
    k.max_dynamic_shared_size_bytes = smem
    res = {}
    for P in (128, 132):
        n = (n_chunks // P) * P  # the same chunks for every mode at this P
        for mode, name in ((0, "static"), (1, "strided"), (2, "dynamic")):
            times, spreads = [], []
            for rep in range(25):
                counter.fill(0)
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                k((P,), (1024,), (buf, np.int64(chunk_bytes // 16), np.int32(n), np.int32(mode), counter, stamps, sink),
                  shared_mem=smem)
                end.record()
                end.synchronize()
                if rep >= 3:
                    times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
                    st = stamps[:3 * P].get().reshape(P, 3).astype(np.int64)
                    e = (st[:, 1] - st[:, 0].min()) / 1e3
                    spreads.append([float(np.min(e)), float(np.median(e)), float(np.max(e)), int(st[:, 2].min()),
                                    int(st[:, 2].max())])
            us = float(np.median(times))
            sp = np.median(np.array(spreads), axis=0)
            res[f"{name}_{P}"] = {"us": us, "tbps": n * chunk_bytes / us / 1e6, "end_min_med_max_us": sp[:3].tolist(),
                                  "chunks_min_max": sp[3:].tolist()}
            print(f"P={P:3d} {name:<8} {us:8.1f} us  {n * chunk_bytes / us / 1e6:.3f} TB/s  CTA ends min/med/max "
                  f"{sp[0]:.0f}/{sp[1]:.0f}/{sp[2]:.0f} us  chunks per CTA {sp[3]:.0f}..{sp[4]:.0f}", flush=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
