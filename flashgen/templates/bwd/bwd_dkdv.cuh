// FlashAttention-2 backward, K/V outer: dK, dV (and dQ by fp32 atomics).
//
// One CTA owns BN key rows of one (batch, KV head). K and V stay in shared
// memory; the CTA walks the query blocks (BM rows) of every query head of its
// GQA group, so dK and dV sum over the group in registers (no extra memory, and
// deterministic). Q, dO and their rows' LSE2 / D stream through an ST-stage
// cp.async ring. Per query block:
//   A: S^T = K Q^T and dP^T = V dO^T (BN x BM, warps WA x NW/WA);
//      P^T = exp2(S^T * scale_log2 - LSE2), dS^T = P^T * (dP^T - D); both to shared memory
//   B: dV += P^T dO, dK += dS^T Q    (BN x D, warps WB x NW/WB, kept in registers)
//   C: dQ += dS K                     (BM x D, warps WC x NW/WC, red.global.add into fp32)
// Causal: query blocks that see none of the CTA's keys are skipped; only blocks
// that cross the diagonal or the key end are masked. The softmax scale of dK is
// applied once at the end; dQ's by bwd_convert.
// User mods (V::USER, common/mod.cuh): the score_mod and its derivative per element (var.score, dS times
// V::dS_factor as a softcap's), and with a mask_mod (V::SPARSE) the query blocks of each query head come
// from the block mask's list for this key block (BlockMask.for_key_tile at this tile: entries
// (query block << 1) | partial), the mask applied on partial blocks and at the key and query ends.
// Packed rows (V::VARLEN_ROWS, common/varlen.cuh): blockIdx.x is a pair (sequence, key block) of
// the work list; the sequence's rows start at cu_q / cu_k and the variant holds its lengths. Query
// rows past the sequence's end (the next sequence's) load as zeros with LSE2 = +inf (P = 0) and add
// nothing to dQ.
#pragma once

template <int D, int BM, int BN, int NW, int ST, int WA, int WB, int WC, bool CAUSAL, bool DQ, bool BF16,
          typename V, typename Params>
FG_DEVICE void bwd_dkdv_body(const Params& p) {
  constexpr int NTH = NW * 32;
  // phase A tiles (rows: keys, columns: queries)
  constexpr int A_RM = BN / WA, A_RN = BM / (NW / WA);
  constexpr int A_MT = A_RM / 16, A_NT = A_RN / 8;
  // phase B tiles (rows: keys, columns: head dim)
  constexpr int B_RM = BN / WB, B_RN = D / (NW / WB);
  constexpr int B_MT = B_RM / 16, B_NT = B_RN / 8;
  // phase C tiles (rows: queries, columns: head dim, in chunks of at most 32 columns). Chunks of
  // 16 when the dK/dV accumulators take >= 128 registers and BM >= 64 (FA2's d=128 64x128x8:
  // 16 fewer fp32 live in phase C, and ptxas then fits the tile; it costs reloading the dS
  // fragments once per chunk). docs/perf/backward.md.
  constexpr int C_RM = BM / WC, C_RN = D / (NW / WC);
  constexpr bool C_NARROW = 2 * BN * D >= 128 * NTH && BM >= 64;
  constexpr int C_MT = C_RM / 16, C_CH = C_RN % 32 == 0 && !C_NARROW ? 32 : 16, C_NT = C_CH / 8;
  static_assert(A_RM % 16 == 0 && A_RN % 16 == 0 && B_RM % 16 == 0 && B_RN % 16 == 0, "bad warp split");
  static_assert(C_RM % 16 == 0 && C_RN % C_CH == 0 && C_CH % 16 == 0, "bad warp split");
  static_assert(BM % 32 == 0 && D % 32 == 0 && ST >= 2, "bad tile shape");

  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int TILE_Q = BM * D * 2, TILE_K = BN * D * 2, TILE_P = BN * BM * 2;
  const fg_u32 sK = smem_addr(smem);
  const fg_u32 sV = sK + TILE_K;
  const fg_u32 sQ = sV + TILE_K;          // ST stages
  const fg_u32 sdO = sQ + ST * TILE_Q;    // ST stages
  const fg_u32 sP = sdO + ST * TILE_Q;
  const fg_u32 sdS = sP + TILE_P;
  const fg_u32 sL = sdS + TILE_P;         // ST stages of BM floats (LSE2), then ST of D
  const fg_u32 sDs = sL + ST * BM * 4;
  const float* fL = reinterpret_cast<const float*>(smem + (2 * TILE_K + 2 * ST * TILE_Q + 2 * TILE_P));
  const float* fD = fL + ST * BM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // grid = (key blocks, KV heads, batch). Packed rows: the list's pair blockIdx.x, sequence b (its
  // first rows q_off, k_off; its lengths go to the variant).
  int b = blockIdx.z;
  const int hk = blockIdx.y;
  int n0 = blockIdx.x * BN;
  int diag = p.nk - p.nq;  // bottom-right causal alignment: query i sees keys j <= i + diag
  fg_seq sq{};
  if constexpr (V::VARLEN_ROWS) {
    int n_block, h_unused;
    if (!fg_varlen_tile(p, static_cast<int>(blockIdx.x) * p.heads, b, n_block, h_unused)) return;
    sq = fg_seq_of(p, b);
    n0 = n_block * BN;
    diag = sq.nk - sq.nq;
  }
  // The offset of batch b's rows of a tensor (strides sb, ss), or of the sequence's from its first row.
  auto rows = [&](fg_i64 sb, fg_i64 ss, int off) { return V::VARLEN_ROWS ? off * ss : b * sb; };

  V var(p);
  if constexpr (V::VARLEN_ROWS) var.set_lengths(sq.nq, sq.nk);
  // The lengths: the call's, or the sequence's (read where used: p.nq, p.nk stay parameter loads).
  const auto nq = [&] { return V::VARLEN_ROWS ? var.nq : p.nq; };
  const auto nk = [&] { return V::VARLEN_ROWS ? var.nk : p.nk; };

  // The query blocks that see this CTA's keys (the variant's rows: causal, a window; common/variant.cuh).
  const int m_first = var.query_first(n0, BM), m_end = var.query_end(n0, BN, BM);
  const int per_head = max(0, m_end - m_first);
  int total = per_head * p.group;
  if constexpr (V::SPARSE) total = bwd_sparse_steps(p, b, hk, n0 / BN);  // (common/bwd_common.cuh)

  // K, V: one group of their own.
  Tile<D>::template load<BN, NTH>(sK, p.k + rows(p.k_sb, p.k_ss, sq.k_off) + hk * p.k_sh, p.k_ss, n0, nk(), p.d);
  Tile<D>::template load<BN, NTH>(sV, p.v + rows(p.v_sb, p.v_ss, sq.k_off) + hk * p.v_sh, p.v_ss, n0, nk(), p.d);
  cp_async_commit();

  // Step `it` covers query head hk*group + it / per_head, query block m_first + it % per_head.
  // Both are walked by counters (no division in the loop): (qh, qm) for the step being loaded,
  // (hc, mc) for the step being computed; each advances by one block, wrapping to the next head.
  auto load_q = [&](int qh, int qm, int stage) {
    const int hq = hk * p.group + qh;
    const int m0 = qm * BM;
    // An opaque thread index: the per-thread load offsets are rebuilt per step, not held across the loop.
    const int tix = static_cast<int>(opaque(static_cast<fg_u32>(tid)));
    const int q_off = V::VARLEN_ROWS ? static_cast<int>(opaque(static_cast<fg_u32>(sq.q_off))) : 0;
    Tile<D>::template load<BM, NTH>(sQ + stage * TILE_Q, p.q + rows(p.q_sb, p.q_ss, q_off) + hq * p.q_sh, p.q_ss,
                                    m0, nq(), p.d, tix);
    Tile<D>::template load<BM, NTH>(sdO + stage * TILE_Q,
                                    p.dout + rows(p.dout_sb, p.dout_ss, q_off) + hq * p.dout_sh, p.dout_ss, m0,
                                    nq(), p.d, tix);
    if constexpr (V::VARLEN_ROWS) {
      // LSE2 and D rows of the sequence (rows hq * nq_pad + cu_q[b] on: no 16-byte alignment), one
      // float per thread; rows past its end get LSE2 = +inf and D = 0.
      const fg_i64 row = static_cast<fg_i64>(hq) * p.nq_pad + q_off + m0;
      for (int i = tid; i < 2 * BM; i += NTH) {
        const int r = i % BM;
        const bool is_l = i < BM;
        const fg_u32 dst = (is_l ? sL : sDs) + stage * BM * 4 + r * 4;
        if (m0 + r < nq()) {
          cp_async_4(dst, (is_l ? p.lse2 : p.dsum) + row + r);
        } else {
          const float fill = is_l ? INFINITY : 0.f;
          asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst), "f"(fill));
        }
      }
    } else {
      // LSE2 and D rows: padded buffers, so whole 16-byte chunks are always in range.
      const fg_i64 row = (static_cast<fg_i64>(b) * p.heads + hq) * p.nq_pad + m0;
      if (tid < BM / 4) {
        cp_async_16(sL + stage * BM * 4 + tid * 16, p.lse2 + row + tid * 4, 16);
      } else if (tid < BM / 2) {
        const int c = tid - BM / 4;
        cp_async_16(sDs + stage * BM * 4 + c * 16, p.dsum + row + c * 4, 16);
      }
    }
  };
  auto next_block = [&](int& h, int& m) {
    if (++m == m_end) {
      m = m_first;
      ++h;
    }
  };
  int qh = 0, qm = m_first;  // the next step to load
  bwd_sparse_walk lq{nullptr, -1, 0, 0}, lc = lq;  // SPARSE: the same as walks of the lists
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < total) {
      if constexpr (V::SPARSE) {
        bool unused;
        const int m_block = lq.next(p, b, hk, n0 / BN, unused);
        load_q(lq.qh, m_block, s);
      } else {
        load_q(qh, qm, s);
        next_block(qh, qm);
      }
    }
    cp_async_commit();
  }
  int hc = 0, mc = m_first;  // the step computed now

  const int a_m0 = (warp % WA) * A_RM, a_n0 = (warp / WA) * A_RN;
  const int b_m0 = (warp % WB) * B_RM, b_n0 = (warp / WB) * B_RN;
  const int c_m0 = (warp % WC) * C_RM, c_n0 = (warp / WC) * C_RN;

  // Per-lane ldmatrix address tables, built once (see KWalk / RowWalk in bwd_common.cuh).
  const KWalk<D> ka = a_kwalk<D>(a_m0);                            // K, V as A of S^T, dP^T
  const KWalk<D> qb = b_kwalk<D>(a_n0);                            // Q, dO as B of S^T, dP^T
  const KWalk<BM> pa = a_kwalk<BM>(b_m0);                          // P^T, dS^T as A of dV, dK
  const RowWalk<D, B_NT / 2> ob = b_rowwalk<D, B_NT / 2>(b_n0);    // dO, Q as B of dV, dK
  const RowWalk<BM, C_MT> sa = a_rowwalk<BM, C_MT>(c_m0);          // dS as A of dQ
  const RowWalk<D, C_RN / 16> kb = b_rowwalk<D, C_RN / 16>(c_n0);  // K as B of dQ (all chunks)

  float acc_dv[B_MT][B_NT][4], acc_dk[B_MT][B_NT][4];
  zero_acc(acc_dv);
  zero_acc(acc_dk);

  for (int it = 0; it < total; ++it) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // step `it` has landed; every warp is done with step it-1
    {
      const int jn = it + ST - 1;
      if (jn < total) {
        if constexpr (V::SPARSE) {
          bool unused;
          const int m_block = lq.next(p, b, hk, n0 / BN, unused);
          load_q(lq.qh, m_block, jn % ST);
        } else {
          load_q(qh, qm, jn % ST);
          next_block(qh, qm);
        }
      }
      cp_async_commit();
    }
    const int stage = it % ST;
    bool partial = false;  // SPARSE: the list's flag for this block
    if constexpr (V::SPARSE) {
      mc = lc.next(p, b, hk, n0 / BN, partial);
      hc = lc.qh;
    }
    const int hq = hk * p.group + hc;
    const int m0 = mc * BM;
    if constexpr (!V::SPARSE) next_block(hc, mc);
    if constexpr (V::HAS_ALIBI || V::USER) var.set_head(p, b, hq);
    const fg_u32 sQs = sQ + stage * TILE_Q, sdOs = sdO + stage * TILE_Q;

    // ---- A: S^T, then P^T (to shared memory), then dP^T and dS^T (to shared memory)
    // S^T and dP^T are never live together: P^T is kept as packed 16-bit pairs
    // (a quarter of the two fp32 tiles), which is also what dS = P (dP - D) reads,
    // so dS uses P rounded to the input dtype, as dV = P^T dO does (and as the
    // same-dtype reference does everywhere). P = 1 and P = 0 stay exact.
    {
      // (SPARSE: the list's partial blocks, and the key and query ends, where a mod's value is anything)
      const bool need_mask = V::SPARSE ? partial || n0 + BN > nk() || m0 + BM > nq()
                                       : var.needs_mask(n0, BN, m0, m0 + BM - 1);
      fg_u32 pt[A_MT][A_NT][2];
      // A softcap's dS factor 1 - t^2 (a score_mod's derivative), packed like P (dS is rounded to the input
      // dtype anyway).
      fg_u32 cap_f[V::DS_FACTOR ? A_MT : 1][V::DS_FACTOR ? A_NT : 1][2];
      {
        float s[A_MT][A_NT][4];
        zero_acc(s);
        warp_mma_t<A_MT, A_NT, D / 16, BF16>(s, sK, ka, sQs, qb);
        const float* Ls = fL + stage * BM;
#pragma unroll
        for (int nj = 0; nj < A_NT; ++nj) {
          const int ql = a_n0 + nj * 8 + 2 * t;
          const float l2[2] = {Ls[ql], Ls[ql + 1]};
#pragma unroll
          for (int mi = 0; mi < A_MT; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float pe[2], cf[2] = {1.f, 1.f};
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                float x = s[mi][nj][2 * h + e];
                if constexpr (V::PLAIN) {
                  if (need_mask) {
                    const int key = n0 + a_m0 + mi * 16 + g + 8 * h;
                    const int qrow = m0 + ql + e;
                    if (key >= nk() || (CAUSAL && key > qrow + diag)) x = -INFINITY;
                  }
                } else {
                  float tv;
                  x = var.score(x, m0 + ql + e, n0 + a_m0 + mi * 16 + g + 8 * h, need_mask, tv);
                  if constexpr (V::DS_FACTOR) cf[e] = V::dS_factor(tv);
                }
                pe[e] = fast_exp2(fmaf(x, p.scale_log2, -l2[e]));
              }
              pt[mi][nj][h] = pack2<BF16>(pe[0], pe[1]);
              if constexpr (V::DS_FACTOR) cap_f[mi][nj][h] = pack2<BF16>(cf[0], cf[1]);
            }
        }
      }
      store_pk_smem<BM, A_MT, A_NT>(sP, pt, a_m0, a_n0);
      {
        float dp[A_MT][A_NT][4];
        zero_acc(dp);
        warp_mma_t<A_MT, A_NT, D / 16, BF16>(dp, sV, ka, sdOs, qb);
        const float* Ds = fD + stage * BM;
#pragma unroll
        for (int nj = 0; nj < A_NT; ++nj) {
          const int ql = a_n0 + nj * 8 + 2 * t;
          const float dd[2] = {Ds[ql], Ds[ql + 1]};
#pragma unroll
          for (int mi = 0; mi < A_MT; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              float pe[2];
              unpack2<BF16>(pt[mi][nj][h], pe[0], pe[1]);
              if constexpr (V::DS_FACTOR) {
                float cf[2];
                unpack2<BF16>(cap_f[mi][nj][h], cf[0], cf[1]);
                pe[0] *= cf[0];
                pe[1] *= cf[1];
              }
              pt[mi][nj][h] = pack2<BF16>(pe[0] * (dp[mi][nj][2 * h] - dd[0]), pe[1] * (dp[mi][nj][2 * h + 1] - dd[1]));
            }
        }
      }
      store_pk_smem<BM, A_MT, A_NT>(sdS, pt, a_m0, a_n0);
    }
    __syncthreads();

    // ---- B: dV += P^T dO, dK += dS^T Q ---------------------------------------
    warp_mma_t<B_MT, B_NT, BM / 16, BF16>(acc_dv, sP, pa, sdOs, ob);
    warp_mma_t<B_MT, B_NT, BM / 16, BF16>(acc_dk, sdS, pa, sQs, ob);

    // ---- C: dQ += dS K by fp32 atomics ----------------------------------------
    if constexpr (DQ) {
      // 32-bit element offsets from the one base pointer (the host keeps the accumulator under
      // 2^32 elements): no 64-bit row pointers live across the loop. Packed rows: (heads, total_q, D)
      // with p.nq = total_q.
      const fg_u32 dq_rows = V::VARLEN_ROWS ? (static_cast<fg_u32>(hq) * p.nq + sq.q_off + m0) * D
                                            : ((static_cast<fg_u32>(b) * p.heads + hq) * p.nq + m0) * D;
#pragma unroll
      for (int ch = 0; ch < C_RN / C_CH; ++ch) {
        float acc[C_MT][C_NT][4];
        zero_acc(acc);
        const int n_off = c_n0 + ch * C_CH;
        warp_mma_t<C_MT, C_NT, BN / 16, BF16>(acc, sdS, sa, sK, kb, ch * (C_NT / 2));
#pragma unroll
        for (int mi = 0; mi < C_MT; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = c_m0 + mi * 16 + g + 8 * h;
            if (m0 + r >= nq()) continue;
#pragma unroll
            for (int nj = 0; nj < C_NT; ++nj) {
              const fg_u32 off = dq_rows + static_cast<fg_u32>(r * D + n_off + nj * 8 + 2 * t);
              red_add_f32x2(p.dq_acc + off, acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
            }
          }
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: dK (times the softmax scale) and dV -----------------------------
  store_acc_global<B_MT, B_NT, BF16>(p.dk + rows(p.dk_sb, p.dk_ss, sq.k_off) + hk * p.dk_sh, p.dk_ss, acc_dk, n0,
                                     b_m0, b_n0, nk(), p.d, p.scale);
  store_acc_global<B_MT, B_NT, BF16>(p.dv + rows(p.dv_sb, p.dv_ss, sq.k_off) + hk * p.dv_sh, p.dv_ss, acc_dv, n0,
                                     b_m0, b_n0, nk(), p.d, 1.f);
}
