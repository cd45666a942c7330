// Standard attention in three passes, the baseline FlashAttention improves on:
//   1. S = scale Q K^T, written to HBM ((batch*heads) x nq x ld, ld = nk rounded up to 8);
//   2. the row softmax of S (causal mask applied here), written in place as P, with the LSE;
//   3. O = P V.
// S and P are stored in the input dtype, as a framework's unfused attention does.
// Tiles wholly above the causal diagonal are neither computed (pass 1) nor read
// (passes 2, 3); pass 2 writes zeros there and in the row padding, so pass 3 can
// load whole 16-byte chunks.
#pragma once

template <bool BF16>
FG_DEVICE float elem_to_float(fg_u32 bits) {  // the low 16 bits hold the element
  if constexpr (BF16) {
    return __uint_as_float(bits << 16);
  } else {
    float f;
    const unsigned short h = static_cast<unsigned short>(bits & 0xffffu);
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
  }
}

// Copy this warp's RW rows of a Tile<W>-staged tile (W columns) to global rows
// of stride `ld` starting at `dst`, 16 bytes per lane; rows >= n_rows and chunks
// at or past `cols` are skipped.
template <int W, int RW>
FG_DEVICE void store_warp_rows(fg_u32 stage, int warp, int lane, elem_t* dst, fg_i64 ld, int row0, int n_rows,
                               int cols) {
  using T = Tile<W>;
  constexpr int CH = RW * (W / 8);
#pragma unroll
  for (int it = 0; it < (CH + 31) / 32; ++it) {
    const int i = it * 32 + lane;
    if (CH % 32 != 0 && i >= CH) break;
    const int r_local = warp * RW + i / (W / 8), c = i % (W / 8);
    const int row = row0 + r_local;
    if (row < n_rows && c * 8 < cols) {
      fg_u32x4 val;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(stage + T::offset(r_local, c)));
      *reinterpret_cast<fg_u32x4*>(dst + static_cast<fg_i64>(row) * ld + c * 8) = val;
    }
  }
}

// ---- pass 1: S = scale Q K^T -------------------------------------------------
// grid = (query blocks * key blocks, heads, batch); warps split the BM query rows.
template <int D, int BM, int BN, int NW, bool CAUSAL, bool BF16, typename Params>
FG_DEVICE void standard_qk_body(const Params& p) {
  constexpr int NT = NW * 32, RW = BM / NW, MI = RW / 16, NJ = BN / 8;
  using TD = Tile<D>;
  using TS = Tile<BN>;
  static_assert(RW % 16 == 0 && BN % 32 == 0, "bad tile shape");
  extern __shared__ __align__(128) unsigned char smem[];
  const fg_u32 sQ = smem_addr(smem);
  const fg_u32 sK = sQ + BM * D * 2;
  const fg_u32 sS = sK + BN * D * 2;

  const int n_nb = ceil_div(p.nk, BN);
  const int m_block = static_cast<int>(blockIdx.x) / n_nb, n_block = static_cast<int>(blockIdx.x) % n_nb;
  const int b = blockIdx.z, hq = blockIdx.y, hk = hq / p.group;
  const int m0 = m_block * BM, n0 = n_block * BN;
  const int diag = p.nk - p.nq;
  if (CAUSAL && n0 > m0 + BM - 1 + diag) return;  // no row of this tile sees any of its keys

  TD::template load<BM, NT>(sQ, p.q + b * p.q_sb + hq * p.q_sh, p.q_ss, m0, p.nq, p.d);
  TD::template load<BN, NT>(sK, p.k + b * p.k_sb + hk * p.k_sh, p.k_ss, n0, p.nk, p.d);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % 4, g = lane / 4;
  const int q_row = warp * RW + (lane & 15);
  const int k_row = ((lane >> 4) << 3) + (lane & 7);
  const typename TD::Cols q_cols(q_row, lane >> 4);
  const typename TD::Cols k_cols(k_row, (lane >> 3) & 1);
  const fg_u32 q_base = sQ + q_row * TD::ROW_BYTES;

  float acc[MI][NJ][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.f;
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
        mma_16816<BF16>(acc[mi][2 * nj2], a[mi], bfrag[0], bfrag[1]);
        mma_16816<BF16>(acc[mi][2 * nj2 + 1], a[mi], bfrag[2], bfrag[3]);
      }
    }
  }

  // Stage this warp's rows of the scaled tile, then store them with 16-byte writes.
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r_local = warp * RW + mi * 16 + g + 8 * h;
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj) {
        const fg_u32 packed = pack2<BF16>(acc[mi][nj][2 * h] * p.scale, acc[mi][nj][2 * h + 1] * p.scale);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sS + TS::offset(r_local, nj) + 4 * t), "r"(packed));
      }
    }
  __syncwarp();
  const fg_i64 bh = static_cast<fg_i64>(b) * p.heads + hq;
  elem_t* s = p.s + bh * p.nq * p.s_ld + n0;
  store_warp_rows<BN, RW>(sS, warp, lane, s, p.s_ld, m0, p.nq, static_cast<int>(p.s_ld) - n0);
}

// ---- pass 2: P = softmax(S) per row, in place; LSE ---------------------------
// grid = (ceil(nq / NW), heads, batch); one warp per row. The first sweep keeps
// a running (max, sum) per lane over its 8-element chunks and merges them
// across the warp (a butterfly of a commutative merge: every lane ends with the
// same bits); the second sweep rereads the row (from L2 for rows of a few
// tens of KB) and writes P, zeros past the causal limit and in the padding.
template <int NW, bool CAUSAL, bool BF16, typename Params>
FG_DEVICE void standard_softmax_body(const Params& p) {
  constexpr float LOG2E = 1.4426950408889634f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int i = static_cast<int>(blockIdx.x) * NW + warp;
  if (i >= p.nq) return;
  const int b = blockIdx.z, hq = blockIdx.y;
  const fg_i64 bh = static_cast<fg_i64>(b) * p.heads + hq;
  elem_t* row = p.s + (bh * p.nq + i) * p.s_ld;
  int limit = p.nk;  // columns >= limit are masked for this row
  if constexpr (CAUSAL) limit = max(0, min(p.nk, i + p.nk - p.nq + 1));
  const int valid_chunks = ceil_div(limit, 8);
  const int all_chunks = static_cast<int>(p.s_ld / 8);

  float m = -INFINITY, l = 0.f;
  for (int c = lane; c < valid_chunks; c += 32) {
    const fg_u32x4 raw = *reinterpret_cast<const fg_u32x4*>(row + c * 8);
    const fg_u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      x[e] = elem_to_float<BF16>(e % 2 ? w[e / 2] >> 16 : w[e / 2]);
      if (c * 8 + e >= limit) x[e] = -INFINITY;
    }
    float mx = m;
#pragma unroll
    for (int e = 0; e < 8; ++e) mx = fmaxf(mx, x[e]);
    if (mx == -INFINITY) continue;  // (not reached for finite S: a valid chunk has a visible column)
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += fast_exp2((x[e] - mx) * LOG2E);
    l = l * fast_exp2((m - mx) * LOG2E) + sum;  // m = -inf: exp2(-inf) = 0, l was 0
    m = mx;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, off);
    const float lo = __shfl_xor_sync(0xffffffffu, l, off);
    const float mx = fmaxf(m, mo);
    if (mx != -INFINITY) {
      l = l * fast_exp2((m - mx) * LOG2E) + lo * fast_exp2((mo - mx) * LOG2E);
      m = mx;
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  const float m_use = m == -INFINITY ? 0.f : m;
  for (int c = lane; c < all_chunks; c += 32) {
    fg_u32x4 out = {0u, 0u, 0u, 0u};
    if (c < valid_chunks) {
      const fg_u32x4 raw = *reinterpret_cast<const fg_u32x4*>(row + c * 8);
      const fg_u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
      fg_u32 o[4];
#pragma unroll
      for (int e2 = 0; e2 < 4; ++e2) {
        float pr[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = c * 8 + 2 * e2 + e;
          const float x = elem_to_float<BF16>(e ? w[e2] >> 16 : w[e2]);
          pr[e] = col < limit ? fast_exp2((x - m_use) * LOG2E) * inv : 0.f;
        }
        o[e2] = pack2<BF16>(pr[0], pr[1]);
      }
      out = {o[0], o[1], o[2], o[3]};
    }
    *reinterpret_cast<fg_u32x4*>(row + c * 8) = out;
  }
  if (p.lse != nullptr && lane == 0) p.lse[bh * p.nq + i] = l > 0.f ? m + logf(l) : -INFINITY;
}

// ---- pass 3: O = P V ---------------------------------------------------------
// grid = (query blocks, heads, batch); P and V tiles stream through an ST-stage
// cp.async ring as K/V do in fwd_v2; P is read as the A operand with ldmatrix.
template <int D, int BM, int BN, int NW, int ST, bool CAUSAL, bool BF16, typename Params>
FG_DEVICE void standard_pv_body(const Params& p) {
  constexpr int NT = NW * 32, RW = BM / NW, MI = RW / 16, DJ = D / 8;
  using TD = Tile<D>;
  using TP = Tile<BN>;
  static_assert(RW % 16 == 0 && BN % 32 == 0 && ST >= 2, "bad tile shape");
  extern __shared__ __align__(128) unsigned char smem[];
  const fg_u32 sP = smem_addr(smem);
  const fg_u32 sV = sP + ST * BM * BN * 2;

  const int m_block = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  const int b = blockIdx.z, hq = blockIdx.y, hk = hq / p.group;
  const fg_i64 bh = static_cast<fg_i64>(b) * p.heads + hq;
  const int m0 = m_block * BM;
  const int diag = p.nk - p.nq;
  const elem_t* pm = p.s + bh * p.nq * p.s_ld;
  const elem_t* v = p.v + b * p.v_sb + hk * p.v_sh;
  const int ld = static_cast<int>(p.s_ld);

  int n_blocks = ceil_div(p.nk, BN);
  if constexpr (CAUSAL) {
    const int limit = m0 + BM + diag;
    n_blocks = limit <= 0 ? 0 : min(n_blocks, ceil_div(limit, BN));
  }
  auto load_stage = [&](int jn) {
    if (jn < n_blocks) {
      const int sn = jn % ST;
      TP::template load<BM, NT>(sP + sn * BM * BN * 2, pm + jn * BN, p.s_ld, m0, p.nq, ld - jn * BN);
      TD::template load<BN, NT>(sV + sn * BN * D * 2, v, p.v_ss, jn * BN, p.nk, p.d);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) load_stage(s);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int p_row = warp * RW + (lane & 15);
  const int v_row = lane & 15;
  const typename TP::Cols p_cols(p_row, lane >> 4);
  const typename TD::Cols v_cols(v_row, lane >> 4);

  float acc[MI][DJ][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int dj = 0; dj < DJ; ++dj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][dj][e] = 0.f;

  for (int j = 0; j < n_blocks; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    load_stage(j + ST - 1);  // refills the stage block j-1 used
    const int stage = j % ST;
    const fg_u32 p_base = sP + stage * BM * BN * 2 + p_row * TP::ROW_BYTES;
    const fg_u32 sVj = sV + stage * BN * D * 2;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      fg_u32 a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], p_base + mi * 16 * TP::ROW_BYTES + p_cols.col(kk));
#pragma unroll
      for (int dj2 = 0; dj2 < DJ / 2; ++dj2) {
        fg_u32 bfrag[4];
        ldmatrix_x4_trans(bfrag, sVj + (kk * 16 + v_row) * TD::ROW_BYTES + v_cols.col(dj2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<BF16>(acc[mi][2 * dj2], a[mi], bfrag[0], bfrag[1]);
          mma_16816<BF16>(acc[mi][2 * dj2 + 1], a[mi], bfrag[2], bfrag[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free: stage O through it

#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r_local = warp * RW + mi * 16 + g + 8 * h;
#pragma unroll
      for (int dj = 0; dj < DJ; ++dj) {
        const fg_u32 packed = pack2<BF16>(acc[mi][dj][2 * h], acc[mi][dj][2 * h + 1]);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sP + TD::offset(r_local, dj) + 4 * t), "r"(packed));
      }
    }
  __syncwarp();
  store_warp_rows<D, RW>(sP, warp, lane, p.o + b * p.o_sb + hq * p.o_sh, p.o_ss, m0, p.nq, p.d);
}
