// FlashAttention-2 backward, query outer: dQ without atomics (deterministic mode).
//
// One CTA owns BM query rows of one (batch, query head) and walks the K/V
// blocks (BN rows, ST-stage cp.async ring) its rows can see:
//   A: S = Q K^T, dP = dO V^T (BM x BN, warps WA x NW/WA);
//      P = exp2(S * scale_log2 - LSE2), dS = P * (dP - D) into shared memory
//   C: dQ += dS K (BM x D, warps WC x NW/WC, in registers for the whole walk)
// and writes dQ * scale in the input dtype. The summation order is fixed, so
// the result does not depend on scheduling.
// User mods (V::USER, common/mod.cuh): the score_mod and its derivative per element (var.score, dS times
// V::dS_factor), and with a mask_mod (V::SPARSE) the key blocks come from the block mask's list for this
// query block (BlockMask.for_tile at this tile), the mask applied on partial blocks and at both ends.
// Packed rows (V::VARLEN_ROWS, common/varlen.cuh): blockIdx.x is a pair (sequence, query block) of
// the work list; the sequence's rows start at cu_q / cu_k and the variant holds its lengths. Rows
// past the sequence's end load as zeros with LSE2 = +inf (P = 0) and are not stored.
#pragma once

template <int D, int BM, int BN, int NW, int ST, int WA, int WC, bool CAUSAL, bool BF16, typename V, typename Params>
FG_DEVICE void bwd_dq_body(const Params& p) {
  constexpr int NTH = NW * 32;
  constexpr int A_RM = BM / WA, A_RN = BN / (NW / WA);
  constexpr int A_MT = A_RM / 16, A_NT = A_RN / 8;
  constexpr int C_RM = BM / WC, C_RN = D / (NW / WC);
  constexpr int C_MT = C_RM / 16, C_NT = C_RN / 8;
  static_assert(A_RM % 16 == 0 && A_RN % 16 == 0 && C_RM % 16 == 0 && C_RN % 16 == 0, "bad warp split");
  static_assert(BN % 32 == 0 && D % 32 == 0 && ST >= 2, "bad tile shape");

  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int TILE_Q = BM * D * 2, TILE_K = BN * D * 2;
  const fg_u32 sQ = smem_addr(smem);
  const fg_u32 sdO = sQ + TILE_Q;
  const fg_u32 sK = sdO + TILE_Q;       // ST stages
  const fg_u32 sV = sK + ST * TILE_K;   // ST stages
  const fg_u32 sdS = sV + ST * TILE_K;  // BM x BN, [query][key]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Causal: the longest rows (highest query blocks) launch first. Packed rows: the list's pair
  // blockIdx.x, sequence b (its first rows q_off, k_off; its lengths go to the variant below).
  int m_block = CAUSAL ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x);
  int b = blockIdx.z;
  const int hq = blockIdx.y, hk = hq / p.group;
  int m0 = m_block * BM;
  int diag = p.nk - p.nq;
  fg_seq sq{};
  if constexpr (V::VARLEN_ROWS) {
    int h_unused;
    if (!fg_varlen_tile(p, static_cast<int>(blockIdx.x) * p.heads, b, m_block, h_unused)) return;
    sq = fg_seq_of(p, b);
    m0 = m_block * BM;
    diag = sq.nk - sq.nq;
  }
  // The offset of batch b's rows of a tensor (strides sb, ss), or of the sequence's from its first row.
  auto rows = [&](fg_i64 sb, fg_i64 ss, int off) { return V::VARLEN_ROWS ? off * ss : b * sb; };
  const elem_t* k = p.k + rows(p.k_sb, p.k_ss, sq.k_off) + hk * p.k_sh;
  const elem_t* v = p.v + rows(p.v_sb, p.v_ss, sq.k_off) + hk * p.v_sh;

  V var(p);
  if constexpr (V::VARLEN_ROWS) var.set_lengths(sq.nq, sq.nk);
  // The lengths: the call's, or the sequence's (read where used: p.nq, p.nk stay parameter loads).
  const auto nq = [&] { return V::VARLEN_ROWS ? var.nq : p.nq; };
  const auto nk = [&] { return V::VARLEN_ROWS ? var.nk : p.nk; };
  // The key blocks some row of this block sees: n_first .. n_first + n_blocks - 1 (common/variant.cuh).
  var.set_head(p, b, hq);
  const int n_first = var.block_first(m0, BN);
  int n_blocks = max(0, var.block_end(m0, BM, BN) - n_first);
  if constexpr (V::SPARSE) {  // (common/mod.cuh: the list of (batch, head, query block))
    var.set_block_row(p, m_block);
    n_blocks = m0 < nq() ? var.count : 0;
  }
  // The j-th K/V block's first key.
  auto key0 = [&](int j) {
    if constexpr (V::SPARSE)
      return var.block_at(j) * BN;
    else
      return (n_first + j) * BN;
  };

  Tile<D>::template load<BM, NTH>(sQ, p.q + rows(p.q_sb, p.q_ss, sq.q_off) + hq * p.q_sh, p.q_ss, m0, nq(), p.d);
  Tile<D>::template load<BM, NTH>(sdO, p.dout + rows(p.dout_sb, p.dout_ss, sq.q_off) + hq * p.dout_sh, p.dout_ss, m0,
                                  nq(), p.d);
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < n_blocks) {
      Tile<D>::template load<BN, NTH>(sK + s * TILE_K, k, p.k_ss, key0(s), nk(), p.d);
      Tile<D>::template load<BN, NTH>(sV + s * TILE_K, v, p.v_ss, key0(s), nk(), p.d);
    }
    cp_async_commit();
  }

  const int a_m0 = (warp % WA) * A_RM, a_n0 = (warp / WA) * A_RN;
  const int c_m0 = (warp % WC) * C_RM, c_n0 = (warp / WC) * C_RN;

  // This thread's rows of S: LSE2 and D, from the padded buffers (no bound check needed). Packed
  // rows: rows past the sequence's end get LSE2 = +inf and D = 0 (the next sequence's are not read).
  const fg_i64 row_base = V::VARLEN_ROWS ? static_cast<fg_i64>(hq) * p.nq_pad + sq.q_off + m0 + a_m0 + g
                                          : (static_cast<fg_i64>(b) * p.heads + hq) * p.nq_pad + m0 + a_m0 + g;
  float l2[A_MT][2], dd[A_MT][2];
#pragma unroll
  for (int mi = 0; mi < A_MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mi * 16 + 8 * h;
      if (V::VARLEN_ROWS && m0 + a_m0 + g + r >= nq()) {
        l2[mi][h] = INFINITY;
        dd[mi][h] = 0.f;
      } else {
        l2[mi][h] = p.lse2[row_base + r];
        dd[mi][h] = p.dsum[row_base + r];
      }
    }

  // Per-lane ldmatrix address tables, built once (KWalk / RowWalk in bwd_common.cuh).
  const KWalk<D> qa = a_kwalk<D>(a_m0);                        // Q, dO as A of S, dP
  const KWalk<D> kb = b_kwalk<D>(a_n0);                        // K, V as B of S, dP
  const KWalk<BN> sa = a_kwalk<BN>(c_m0);                      // dS as A of dQ
  const RowWalk<D, C_NT / 2> kc = b_rowwalk<D, C_NT / 2>(c_n0);  // K as B of dQ

  float acc[C_MT][C_NT][4];
  zero_acc(acc);

  for (int j = 0; j < n_blocks; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();
    {
      const int jn = j + ST - 1;
      if (jn < n_blocks) {
        const int sn = jn % ST;
        Tile<D>::template load<BN, NTH>(sK + sn * TILE_K, k, p.k_ss, key0(jn), nk(), p.d);
        Tile<D>::template load<BN, NTH>(sV + sn * TILE_K, v, p.v_ss, key0(jn), nk(), p.d);
      }
      cp_async_commit();
    }
    const int stage = j % ST;
    const fg_u32 sKj = sK + stage * TILE_K, sVj = sV + stage * TILE_K;
    const int n0 = key0(j);

    {
      float s[A_MT][A_NT][4], dp[A_MT][A_NT][4];
      zero_acc(s);
      zero_acc(dp);
      warp_mma_t<A_MT, A_NT, D / 16, BF16>(s, sQ, qa, sKj, kb);
      warp_mma_t<A_MT, A_NT, D / 16, BF16>(dp, sdO, qa, sVj, kb);
      bool need_mask;
      if constexpr (V::SPARSE)  // (the list's partial blocks, and the key and query ends: a mod's value is anything)
        need_mask = var.partial_at(j) || n0 + BN > nk() || m0 + BM > nq();
      else
        need_mask = var.needs_mask(n0, BN, m0, m0 + BM - 1);
#pragma unroll
      for (int mi = 0; mi < A_MT; ++mi)
#pragma unroll
        for (int nj = 0; nj < A_NT; ++nj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e >> 1;
            float x = s[mi][nj][e], cf = 1.f;
            if constexpr (V::PLAIN) {
              if (need_mask) {
                const int qrow = m0 + a_m0 + mi * 16 + g + 8 * h;
                const int key = n0 + a_n0 + nj * 8 + 2 * t + (e & 1);
                if (key >= nk() || (CAUSAL && key > qrow + diag)) x = -INFINITY;
              }
            } else {
              float tv;
              x = var.score(x, m0 + a_m0 + mi * 16 + g + 8 * h, n0 + a_n0 + nj * 8 + 2 * t + (e & 1), need_mask, tv);
              if constexpr (V::DS_FACTOR) cf = V::dS_factor(tv);
            }
            const float pe = fast_exp2(fmaf(x, p.scale_log2, -l2[mi][h]));
            dp[mi][nj][e] = pe * cf * (dp[mi][nj][e] - dd[mi][h]);
          }
      store_acc_smem<BN, A_MT, A_NT, BF16>(sdS, dp, a_m0, a_n0);
    }
    __syncthreads();
    warp_mma_t<C_MT, C_NT, BN / 16, BF16>(acc, sdS, sa, sKj, kc);
  }
  cp_async_wait<0>();
  store_acc_global<C_MT, C_NT, BF16>(p.dq + rows(p.dq_sb, p.dq_ss, sq.q_off) + hq * p.dq_sh, p.dq_ss, acc, m0, c_m0,
                                     c_n0, nq(), p.d, p.scale);
}
