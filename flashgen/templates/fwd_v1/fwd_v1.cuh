// FlashAttention V1's loop order on mma.sync (sm_80+): K/V outside, Q inside.
//
// One CTA per (K/V block j, head, batch). It keeps K_j and V_j in shared memory
// and walks the query blocks i in increasing order; for each it reads Q_i and
// the running state of those rows from HBM (partial O in fp32, row max m, row
// sum l), folds in S = Q_i K_j^T with the online softmax, and writes the state
// back. The last K/V block a query block sees writes the normalised O (input
// dtype) and the LSE instead; the first starts from O = 0, m = -inf, l = 0
// without reading. Inside the CTA the warps split the query rows (as in fwd_v2):
// that is not V1's warp split, but the HBM traffic, which is the point, is V1's.
//
// Ordering (exact and deterministic): every query block receives the K/V blocks
// in the fixed order 0, 1, 2, ... A per-(batch, head) counter hands out K/V
// block numbers in the order CTAs start (a ticket), and a per-query-block
// progress word holds how many K/V blocks have been folded in. The CTA holding
// block j waits until the progress of Q block i equals j (acquire), updates,
// and stores j + 1 (release). Tickets follow start order, so the CTA owning
// block j - 1 is already resident or finished when block j waits on it: the
// chain always ends at block 0, which never waits, and cannot deadlock. The
// result does not depend on scheduling: two runs give the same bits.
//
// Causal (bottom-right): Q block i sees K/V blocks 0 .. last(i); block 0 also
// visits fully masked Q blocks, so that every row gets written (O = 0, LSE -inf).
#pragma once

FG_DEVICE int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
FG_DEVICE void st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Loads of the running state written by another CTA: through L2 (.cg), never a stale L1 line.
FG_DEVICE float2 ld_cg_f2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}

template <int D, int BM, int BN, int NW, bool CAUSAL, bool BF16, typename Params>
FG_DEVICE void fwd_v1_body(const Params& p) {
  constexpr int NT = NW * 32;
  constexpr int RW = BM / NW, MI = RW / 16, NJ = BN / 8, DJ = D / 8;
  using TD = Tile<D>;
  static_assert(RW % 16 == 0 && BN % 16 == 0, "bad tile shape");

  extern __shared__ __align__(128) unsigned char smem[];
  const fg_u32 sK = smem_addr(smem);
  const fg_u32 sV = sK + BN * D * 2;
  const fg_u32 sQ = sV + BN * D * 2;  // two stages of BM x D
  __shared__ int s_ticket;

  const int b = blockIdx.z, hq = blockIdx.y, hk = hq / p.group;
  const int bh = b * p.heads + hq;
  const int n_qb = ceil_div(p.nq, BM), n_kb = ceil_div(p.nk, BN);
  const int diag = p.nk - p.nq;
  int* sync = p.sync + static_cast<fg_i64>(bh) * (1 + n_qb);
  if (threadIdx.x == 0) s_ticket = atomicAdd(sync, 1);
  __syncthreads();
  const int j = s_ticket;  // this CTA's K/V block
  const int n0 = j * BN;
  // The last K/V block Q block i sees (>= 0: block 0 visits every Q block).
  auto last_of = [&](int i) {
    if constexpr (!CAUSAL) return n_kb - 1;
    const int limit = i * BM + BM + diag;  // keys below this are seen by some row of the block
    return limit <= 0 ? 0 : min(n_kb, ceil_div(limit, BN)) - 1;
  };
  int i = 0;
  if constexpr (CAUSAL) {
    while (i < n_qb && last_of(i) < j) ++i;  // last_of grows with i
  }

  const elem_t* q = p.q + b * p.q_sb + hq * p.q_sh;
  TD::template load<BN, NT>(sK, p.k + b * p.k_sb + hk * p.k_sh, p.k_ss, n0, p.nk, p.d);
  TD::template load<BN, NT>(sV, p.v + b * p.v_sb + hk * p.v_sh, p.v_ss, n0, p.nk, p.d);
  if (i < n_qb) TD::template load<BM, NT>(sQ, q, p.q_ss, i * BM, p.nq, p.d);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int q_row = warp * RW + (lane & 15);
  const int k_row = ((lane >> 4) << 3) + (lane & 7);
  const int v_row = lane & 15;
  const typename TD::Cols q_cols(q_row, lane >> 4);
  const typename TD::Cols k_cols(k_row, (lane >> 3) & 1);
  const typename TD::Cols v_cols(v_row, lane >> 4);
  const fg_i64 row_base = static_cast<fg_i64>(bh) * p.nq;

  for (int it = 0; i < n_qb; ++i, ++it) {
    // Prefetch the next Q block into the other stage (read-only: no need to wait for its turn).
    const fg_u32 sQi = sQ + (it % 2) * BM * D * 2;
    if (i + 1 < n_qb) TD::template load<BM, NT>(sQ + ((it + 1) % 2) * BM * D * 2, q, p.q_ss, (i + 1) * BM, p.nq, p.d);
    cp_async_commit();
    const int m0 = i * BM;
    const bool first = j == 0, last = j == last_of(i);
    if (threadIdx.x == 0 && !first) {
      int* progress = sync + 1 + i;
      while (ld_acquire(progress) != j) asm volatile("nanosleep.u32 64;\n");
    }
    cp_async_wait<1>();
    __syncthreads();

    // Running state of this thread's rows (g and g+8 of each slice): O, max, and the sum, whose
    // per-thread partials are quad-summed on the way out (lane t = 0 carries the stored sum in).
    float acc_o[MI][DJ][4];
    float row_max[MI][2], row_sum[MI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + warp * RW + mi * 16 + g + 8 * h;
        float2 ml = make_float2(-INFINITY, 0.f);
        if (!first && row < p.nq) ml = ld_cg_f2(p.ml + (row_base + row) * 2);
        row_max[mi][h] = ml.x;
        row_sum[mi][h] = t == 0 ? ml.y : 0.f;
#pragma unroll
        for (int dj = 0; dj < DJ; ++dj) {
          float2 o = make_float2(0.f, 0.f);
          if (!first && row < p.nq) o = ld_cg_f2(p.acc + (row_base + row) * D + dj * 8 + 2 * t);
          acc_o[mi][dj][2 * h] = o.x;
          acc_o[mi][dj][2 * h + 1] = o.y;
        }
      }

    // ---- S = Q_i K_j^T ---------------------------------------------------------
    float acc_s[MI][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mi][nj][e] = 0.f;
    const fg_u32 q_base = sQi + q_row * TD::ROW_BYTES;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      fg_u32 a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], q_base + mi * 16 * TD::ROW_BYTES + q_cols.col(kk));
#pragma unroll
      for (int nj2 = 0; nj2 < NJ / 2; ++nj2) {
        fg_u32 bfrag[4];
        ldmatrix_x4(bfrag, sK + (nj2 * 16 + k_row) * TD::ROW_BYTES + k_cols.col(kk));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<BF16>(acc_s[mi][2 * nj2], a[mi], bfrag[0], bfrag[1]);
          mma_16816<BF16>(acc_s[mi][2 * nj2 + 1], a[mi], bfrag[2], bfrag[3]);
        }
      }
    }

    // ---- mask: the sequence end and the causal diagonal ------------------------
    if (n0 + BN > p.nk || (CAUSAL && n0 + BN - 1 > m0 + diag)) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int limit = p.nk;
          if constexpr (CAUSAL) limit = min(limit, m0 + warp * RW + mi * 16 + g + 8 * h + diag + 1);
          mask_row(acc_s[mi], h, limit - (n0 + 2 * t));
        }
    }

    // ---- online softmax against the stored state --------------------------------
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) softmax_step(acc_s[mi], acc_o[mi], h, row_max[mi][h], row_sum[mi][h], p.scale_log2);

    // ---- O += P V_j ----------------------------------------------------------------
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      fg_u32 a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) p_frag<BF16>(a[mi], acc_s[mi], kk);
#pragma unroll
      for (int dj2 = 0; dj2 < DJ / 2; ++dj2) {
        fg_u32 bfrag[4];
        ldmatrix_x4_trans(bfrag, sV + (kk * 16 + v_row) * TD::ROW_BYTES + v_cols.col(dj2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<BF16>(acc_o[mi][2 * dj2], a[mi], bfrag[0], bfrag[1]);
          mma_16816<BF16>(acc_o[mi][2 * dj2 + 1], a[mi], bfrag[2], bfrag[3]);
        }
      }
    }

    // ---- write back: the running state, or the final O and LSE -----------------
    if (!last) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + warp * RW + mi * 16 + g + 8 * h;
          const float l = quad_sum(row_sum[mi][h]);
          if (row < p.nq) {
            float* o = p.acc + (row_base + row) * D + 2 * t;
#pragma unroll
            for (int dj = 0; dj < DJ; ++dj)
              *reinterpret_cast<float2*>(o + dj * 8) = make_float2(acc_o[mi][dj][2 * h], acc_o[mi][dj][2 * h + 1]);
            if (t == 0) *reinterpret_cast<float2*>(p.ml + (row_base + row) * 2) = make_float2(row_max[mi][h], l);
          }
        }
    } else {
      // Stage O through this warp's own rows of the Q stage it just used, then 16-byte stores.
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float l = quad_sum(row_sum[mi][h]);
          const float inv = row_inv(l);
          const int r_local = warp * RW + mi * 16 + g + 8 * h;
#pragma unroll
          for (int dj = 0; dj < DJ; ++dj) {
            const fg_u32 packed = pack2<BF16>(acc_o[mi][dj][2 * h] * inv, acc_o[mi][dj][2 * h + 1] * inv);
            asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sQi + TD::offset(r_local, dj) + 4 * t), "r"(packed));
          }
          const int row = m0 + r_local;
          if (p.lse != nullptr && t == 0 && row < p.nq)
            p.lse[row_base + row] = row_lse(row_max[mi][h], l, p.scale);
        }
      __syncwarp();
      elem_t* o = p.o + b * p.o_sb + hq * p.o_sh;
      constexpr int CH = RW * (D / 8);
#pragma unroll
      for (int c_it = 0; c_it < (CH + 31) / 32; ++c_it) {
        const int idx = c_it * 32 + lane;
        if (CH % 32 != 0 && idx >= CH) break;
        const int r_local = warp * RW + idx / (D / 8), c = idx % (D / 8);
        const int row = m0 + r_local;
        if (row < p.nq && c * 8 < p.d) {
          fg_u32x4 val;
          asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                       : "r"(sQi + TD::offset(r_local, c)));
          *reinterpret_cast<fg_u32x4*>(o + static_cast<fg_i64>(row) * p.o_ss + c * 8) = val;
        }
      }
    }
    // Publish: every thread's stores, then the progress word (release). The barrier also frees the
    // Q stage for the prefetch of the next iteration.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && !last) st_release(sync + 1 + i, j + 1);
  }
  cp_async_wait<0>();
}
