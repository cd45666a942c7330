// FlashAttention-2 forward on mma.sync (sm_80+).
//
// One CTA owns BM query rows of one (batch, head); its warps split those rows
// (split-Q: warp w owns rows [w*RW, (w+1)*RW), so no warp ever needs another's
// softmax state). K/V blocks of BN rows stream through an ST-stage cp.async
// ring. Per block: S = Q K^T in registers, the variant's score transforms
// (softcap, ALiBi), mask only where the block crosses the sequence end or a
// row's visible range (the causal diagonal, a window's sides), online softmax
// with the scale folded into exp2, P packed straight from the S accumulators
// into A fragments, O += P V. Only the key blocks some row of the CTA sees are
// loaded (V: common/variant.cuh). Normalisation by the row sum (and a sink)
// happens once, at the end. User mods with a block mask (V::SPARSE,
// common/mod.cuh): the CTA walks its query block's list of key blocks instead of
// a range, masking only the partial ones.
#pragma once

template <int D, int BM, int BN, int NW, int ST, int REFILL, bool CAUSAL, bool BF16, typename V, typename Params>
FG_DEVICE void fwd_v2_body(const Params& p) {
  constexpr int NT = NW * 32;
  constexpr int RW = BM / NW;  // query rows per warp
  constexpr int MI = RW / 16;  // 16-row slices per warp
  constexpr int NJ = BN / 8;   // n8 tiles of S per slice
  constexpr int DJ = D / 8;    // n8 tiles of O per slice
  using TQ = Tile<D>;
  static_assert(RW % 16 == 0 && BN % 16 == 0 && D % 32 == 0 && ST >= 2, "bad tile shape");

  extern __shared__ __align__(128) unsigned char smem[];
  const fg_u32 sQ = smem_addr(smem);
  const fg_u32 sK = sQ + BM * D * 2;
  const fg_u32 sV = sK + ST * BN * D * 2;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // grid = (query blocks, heads, batch). Causal (and a block mask: causal-like masks are the common
  // ones): the longest rows (highest query blocks) launch first.
  // Packed rows (V::VARLEN_ROWS, common/varlen.cuh): grid = (the host's bound on the list, heads, 1),
  // blockIdx.x the list's pair (sequence b, query block), longest first; past the list, nothing to do.
  int m_block = (CAUSAL || V::SPARSE) ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  int b = blockIdx.z;
  const int hq = blockIdx.y, hk = hq / p.group;
  // The keys each row sees (bottom-right aligned), the score transforms and the sink of this head; the
  // CTA's key blocks are n_first .. n_first + n_blocks - 1.
  V var(p);
  // Packed rows: the sequence's first query and key row (its lengths go to the variant).
  fg_i64 q_rows = static_cast<fg_i64>(b) * p.q_sb, k_rows = static_cast<fg_i64>(b) * p.k_sb,
         v_rows = static_cast<fg_i64>(b) * p.v_sb, o_rows = static_cast<fg_i64>(b) * p.o_sb;
  fg_i64 lse_base = (static_cast<fg_i64>(b) * p.heads + hq) * p.nq;
  if constexpr (V::VARLEN_ROWS) {
    int h_unused;
    if (!fg_varlen_tile(p, static_cast<int>(blockIdx.x) * p.heads, b, m_block, h_unused)) return;
    const fg_seq sq = fg_seq_of(p, b);
    var.set_lengths(sq.nq, sq.nk);
    q_rows = sq.q_off * p.q_ss, k_rows = sq.k_off * p.k_ss, v_rows = sq.k_off * p.v_ss, o_rows = sq.q_off * p.o_ss;
    lse_base = static_cast<fg_i64>(hq) * p.nq + sq.q_off;
  }
  const int m0 = m_block * BM;
  const elem_t* q = p.q + q_rows + hq * p.q_sh;
  const elem_t* k = p.k + k_rows + hk * p.k_sh;
  const elem_t* v = p.v + v_rows + hk * p.v_sh;
  var.set_head(p, b, hq);
  if constexpr (V::SPARSE) var.set_block_row(p, m_block);
  const int n_first = var.block_first(m0, BN);
  int n_blocks;
  if constexpr (V::SPARSE) n_blocks = m0 < var.nq ? var.count : 0;  // (the list's length)
  else n_blocks = max(0, var.block_end(m0, BM, BN) - n_first);
  // The key block of the CTA's j-th K/V block: a block mask's list entry, else the range's.
  auto kv_block = [&](int j) { if constexpr (V::SPARSE) return var.block_at(j); else return n_first + j; };

  // Prologue: Q (its own group), then K/V blocks 0 .. ST-2.
  TQ::template load<BM, NT>(sQ, q, p.q_ss, m0, var.nq, p.d);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < n_blocks) {
      TQ::template load<BN, NT>(sK + s * BN * D * 2, k, p.k_ss, kv_block(s) * BN, var.nk, p.d);
      TQ::template load<BN, NT>(sV + s * BN * D * 2, v, p.v_ss, kv_block(s) * BN, var.nk, p.d);
    }
    cp_async_commit();
  }

  float acc_o[MI][DJ][4];
  float row_max[MI][2], row_sum[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int dj = 0; dj < DJ; ++dj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][dj][e] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  // Per-lane ldmatrix coordinates (KERNELS.md section 2):
  //  Q as A:          row warp*RW + mi*16 + (lane & 15),       chunk 2*kk + (lane >> 4)
  //  K as B:          row nj2*16 + (lane >> 4)*8 + (lane & 7), chunk 2*kk + ((lane >> 3) & 1)
  //  V as B (.trans): row kk*16 + (lane & 15),                 chunk 2*dj2 + (lane >> 4)
  const int q_row = warp * RW + (lane & 15);
  const int k_row = ((lane >> 4) << 3) + (lane & 7);
  const int v_row = lane & 15;
  const typename TQ::Cols q_cols(q_row, lane >> 4);
  const typename TQ::Cols k_cols(k_row, (lane >> 3) & 1);
  const fg_u32 q_base = sQ + q_row * TQ::ROW_BYTES;  // V rows share q_cols: same r % 8, same c0

  for (int j = 0; j < n_blocks; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    // Refill the stage block j-1 used with block j+ST-1. Where in the iteration
    // the copy is issued (REFILL: 0 before S = QK^T, 1 before the softmax, 2
    // before O += PV) changes nothing but the schedule and the registers ptxas
    // needs, and so which tiles compile without spilling: a tuning knob.
    auto refill = [&]() {
      const int jn = j + ST - 1;
      if (jn < n_blocks) {
        const int sn = jn % ST;
        TQ::template load<BN, NT>(sK + sn * BN * D * 2, k, p.k_ss, kv_block(jn) * BN, var.nk, p.d);
        TQ::template load<BN, NT>(sV + sn * BN * D * 2, v, p.v_ss, kv_block(jn) * BN, var.nk, p.d);
      }
      cp_async_commit();
    };
    if constexpr (REFILL == 0) refill();
    const int stage = j % ST;
    const fg_u32 sKj = sK + stage * BN * D * 2;
    const fg_u32 sVj = sV + stage * BN * D * 2;

    // ---- S = Q K^T ----------------------------------------------------------
    float acc_s[MI][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mi][nj][e] = 0.f;

#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      fg_u32 a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        ldmatrix_x4(a[mi], q_base + mi * 16 * TQ::ROW_BYTES + q_cols.col(kk));
      }
#pragma unroll
      for (int nj2 = 0; nj2 < NJ / 2; ++nj2) {
        fg_u32 bfrag[4];
        ldmatrix_x4(bfrag, sKj + (nj2 * 16 + k_row) * TQ::ROW_BYTES + k_cols.col(kk));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<BF16>(acc_s[mi][2 * nj2], a[mi], bfrag[0], bfrag[1]);
          mma_16816<BF16>(acc_s[mi][2 * nj2 + 1], a[mi], bfrag[2], bfrag[3]);
        }
      }
    }

    if constexpr (REFILL == 1) refill();

    // ---- transforms, then the mask (only blocks that cross the sequence end or a row's range) ----
    const int n0 = kv_block(j) * BN;
    if constexpr (V::TRANSFORMS) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) var.transform(acc_s[mi], h, m0 + warp * RW + mi * 16 + g + 8 * h, n0 + 2 * t);
    }
    bool masked;
    if constexpr (V::SPARSE) masked = var.partial_at(j) || n0 + BN > var.nk;  // (the list's flag)
    else masked = var.needs_mask(n0, BN, m0, m0 + BM - 1);
    if (masked) {
      // Columns outside the row's range are hidden; one compare per element against per-row bounds
      // instead of building row and column indices.
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) var.mask(acc_s[mi], h, m0 + warp * RW + mi * 16 + g + 8 * h, n0 + 2 * t);
    }

    // ---- online softmax: new row max, rescale O and the row sum, P = exp2 ----
    // (Skipping the O rescale when no row max grew was tried: a warp vote and
    // branch per block cost more than the multiplies; docs/perf/forward-mma.md.)
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) softmax_step(acc_s[mi], acc_o[mi], h, row_max[mi][h], row_sum[mi][h], p.scale_log2);

    if constexpr (REFILL == 2) refill();

    // ---- O += P V, P taken from the S accumulators as A fragments ------------
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      fg_u32 a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) p_frag<BF16>(a[mi], acc_s[mi], kk);
#pragma unroll
      for (int dj2 = 0; dj2 < DJ / 2; ++dj2) {
        fg_u32 bfrag[4];
        ldmatrix_x4_trans(bfrag, sVj + (kk * 16 + v_row) * TQ::ROW_BYTES + q_cols.col(dj2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<BF16>(acc_o[mi][2 * dj2], a[mi], bfrag[0], bfrag[1]);
          mma_16816<BF16>(acc_o[mi][2 * dj2 + 1], a[mi], bfrag[2], bfrag[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  // Q chunks were copied by all threads; when no K/V block ran (fully masked
  // or empty key range) nothing has synchronised since, and the O staging
  // below reuses the Q rows.
  __syncthreads();

  // ---- epilogue: normalise, stage O through this warp's own Q rows, store ----
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(row_sum[mi][h]);
      float inv, lse;
      var.finish(row_max[mi][h], l, p.scale, inv, lse);
      const int r_local = warp * RW + mi * 16 + g + 8 * h;
#pragma unroll
      for (int dj = 0; dj < DJ; ++dj) {
        const fg_u32 packed = pack2<BF16>(acc_o[mi][dj][2 * h] * inv, acc_o[mi][dj][2 * h + 1] * inv);
        const fg_u32 addr = sQ + TQ::offset(r_local, dj) + 4 * t;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed));
      }
      const int row = m0 + r_local;
      if (p.lse != nullptr && t == 0 && row < var.nq)
        p.lse[lse_base + row] = lse;
      // With a sink and p.o32 set: the normalised O in fp32, (b, heads, nq, d), for the backward's D (as
      // fwd_sm90's store_o32).
      if constexpr (V::HAS_SINK) {
        if (p.o32 != nullptr && row < var.nq) {
          float* dst = p.o32 + (lse_base + row) * p.d;
#pragma unroll
          for (int dj = 0; dj < DJ; ++dj)
            if (8 * dj + 2 * t < p.d)
              *reinterpret_cast<float2*>(dst + 8 * dj + 2 * t) =
                  make_float2(acc_o[mi][dj][2 * h] * inv, acc_o[mi][dj][2 * h + 1] * inv);
        }
      }
    }
  __syncwarp();
  elem_t* o = p.o + o_rows + hq * p.o_sh;
  constexpr int CH = RW * (D / 8);
#pragma unroll
  for (int it = 0; it < (CH + 31) / 32; ++it) {
    const int i = it * 32 + lane;
    if (CH % 32 != 0 && i >= CH) break;
    const int r_local = warp * RW + i / (D / 8), c = i % (D / 8);
    const int row = m0 + r_local;
    if (row < var.nq && c * 8 < p.d) {
      fg_u32x4 val;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(sQ + TQ::offset(r_local, c)));
      *reinterpret_cast<fg_u32x4*>(o + static_cast<fg_i64>(row) * p.o_ss + c * 8) = val;
    }
  }
}
