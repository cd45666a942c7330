// Backward-pass helpers: warp-tiled GEMMs over swizzled shared-memory tiles,
// fragment stores, fp32 atomics, row-wise preprocess and dQ conversion.
//
// Every operand of a backward GEMM lives in shared memory as a Tile<W> (rows of
// W 16-bit elements, 16-byte chunks XOR-swizzled). An operand can be stored
// either way round; ldmatrix (plain or .trans) turns it into mma fragments:
//   A (m x k) stored [m][k]: plain,  lanes address rows m0 + (lane & 15), chunk + (lane >> 4)
//   A (m x k) stored [k][m]: .trans, lanes address rows k0 + 8 (lane >> 4) + (lane & 7), chunk + ((lane >> 3) & 1)
//   B (k x n) stored [n][k]: plain,  same lanes as the [k][m] A
//   B (k x n) stored [k][n]: .trans, same lanes as the [m][k] A
// (KERNELS.md section 2: with .trans a lane receives the transposed 8x8 pieces.)
#pragma once

template <bool BF16>
FG_DEVICE float to_f32(unsigned short x) {
  if constexpr (BF16) {
    return __uint_as_float(static_cast<fg_u32>(x) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  }
}

FG_DEVICE void red_add_f32(float* addr, float v) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(v) : "memory");
}

// Two adjacent floats (8-byte aligned): one vector reduction on sm_90 (PTX 8.1
// `red.global.add.v2.f32`), two scalar ones before. Halves the atomics of dQ.
FG_DEVICE void red_add_f32x2(float* addr, float v0, float v1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(v0), "f"(v1) : "memory");
#else
  red_add_f32(addr, v0);
  red_add_f32(addr + 1, v1);
#endif
}

// Four consecutive floats (16-byte aligned): one vector reduction on sm_90.
FG_DEVICE void red_add_f32x4(float* addr, float v0, float v1, float v2, float v3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(v0), "f"(v1), "f"(v2), "f"(v3)
               : "memory");
#else
  red_add_f32x2(addr, v0, v1);
  red_add_f32x2(addr + 2, v2, v3);
#endif
}

template <int MT, int NT>
FG_DEVICE void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nj = 0; nj < NT; ++nj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.f;
}

// acc (16*MT rows from m0, 8*NT columns from n0 of the output) += A B over
// k = 0 .. 16*KT. A_KM: A stored [k][m] in a Tile<AW>, else [m][k]. B_KN: B
// stored [k][n] in a Tile<BW>, else [n][k].
// Hides a value from the optimizer: addresses derived from it are computed where
// they are used instead of being hoisted out of the main loop, where hundreds of
// loop-invariant fragment addresses would each hold a register.
FG_DEVICE fg_u32 opaque(fg_u32 x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}

template <int MT, int NT, int KT, bool A_KM, bool B_KN, int AW, int BW, bool BF16>
FG_DEVICE void warp_mma(float (&acc)[MT][NT][4], fg_u32 sA, int m0, fg_u32 sB, int n0) {
  static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
  sA = opaque(sA);
  sB = opaque(sB);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int r1 = lane & 15, c1 = lane >> 4;
  const int r2 = ((lane >> 4) << 3) + (lane & 7), c2 = (lane >> 3) & 1;
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    fg_u32 a[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      if constexpr (A_KM) {
        ldmatrix_x4_trans(a[mi], sA + Tile<AW>::offset(kk * 16 + r2, m0 / 8 + mi * 2 + c2));
      } else {
        ldmatrix_x4(a[mi], sA + Tile<AW>::offset(m0 + mi * 16 + r1, kk * 2 + c1));
      }
    }
#pragma unroll
    for (int nj2 = 0; nj2 < NT / 2; ++nj2) {
      fg_u32 b[4];
      if constexpr (B_KN) {
        ldmatrix_x4_trans(b, sB + Tile<BW>::offset(kk * 16 + r1, n0 / 8 + nj2 * 2 + c1));
      } else {
        ldmatrix_x4(b, sB + Tile<BW>::offset(n0 + nj2 * 16 + r2, kk * 2 + c2));
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        mma_16816<BF16>(acc[mi][2 * nj2], a[mi], b[0], b[1]);
        mma_16816<BF16>(acc[mi][2 * nj2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// ---- per-lane ldmatrix address tables (the forward's Tile::Cols idiom) ----------
// Every lane's ldmatrix rows are r, r + 16, ... with r % 8 == lane % 8 (for all
// four operand roles), so one lane's swizzle is the same on all its rows. An
// operand walked along k by chunks (plain ldmatrix) needs 4 (+2 for a C % 8 == 4
// tail) byte offsets; one walked along k by rows (.trans) needs one offset per
// 16-column step. Built once before the main loop, these ~20 registers replace
// the per-(k step, m step) offsets the compiler otherwise hoists out of it.
// at(i, kk): byte offset of the i-th 16-row (KWalk) / 16-column (RowWalk) step
// at the kk-th k step of 16; kk and i are compile-time, so the rest folds into
// the ldmatrix immediate.
template <int W>
struct KWalk {  // [rows][k], plain ldmatrix
  static constexpr bool TRANS = false;
  static constexpr int C = Tile<W>::C, RB = Tile<W>::ROW_BYTES;
  fg_u32 main[4], tail[2];
  FG_DEVICE KWalk(int row, int c0) {
    const typename Tile<W>::Cols cols(row, c0);
    const fg_u32 rb = static_cast<fg_u32>(row * RB);
#pragma unroll
    for (int i = 0; i < 4; ++i) main[i] = rb + cols.main[i];
#pragma unroll
    for (int i = 0; i < 2; ++i) tail[i] = rb + cols.tail[i];
  }
  // (A one-register XOR form like RowWalk's below was tried here too: the d=128 64x128x8
  // bwd_dkdv spilled 8-48 B more with it under NVRTC 13.5; docs/perf/backward.md.)
  FG_DEVICE const KWalk& fresh() const { return *this; }
  FG_DEVICE fg_u32 at(int i, int kk) const {
    return static_cast<fg_u32>(i * 16 * RB) +
           (2 * kk < (C & ~7) ? 128 * (kk >> 2) + main[kk & 3] : tail[kk - (C & ~7) / 2]);
  }
};

// With C % 8 == 0 (every chunk swizzled as c ^ (r % 8)) RowWalk's table shrinks to one
// register: the lane's offset lb of its first chunk; the chunk 2j further on is at
// lb ^ 16 (2j % 8) + 128 (2j / 8), one LOP3 per ldmatrix. warp_mma_t takes a fresh()
// copy per call (lb through opaque()), so the XORed offsets are rebuilt per GEMM
// instead of being hoisted out of the main loop, where they would be the table again.
// The chunks are chunk0 + 2j + c0 (j < N) with chunk0 a multiple of 2N (callers pass
// a warp's own 16N columns, m0 = warp index * 16N): for 2N <= 8 a power of two,
// chunk0 % 8 + 2j + c0 has disjoint bits (no carry), and for 2N % 8 == 0 chunk0 % 8
// == 0; either way the XOR form holds. Other N keep the table.
template <int W, int N>
struct RowWalk {  // [k][columns], .trans ldmatrix; N steps of 16 columns from chunk0
  static constexpr bool TRANS = true;
  static constexpr int RB = Tile<W>::ROW_BYTES;
  static constexpr bool XOR = Tile<W>::C % 8 == 0 && ((2 * N) % 8 == 0 || 8 % (2 * N) == 0);
  fg_u32 col[XOR ? 1 : N];
  FG_DEVICE RowWalk() {}
  FG_DEVICE RowWalk(int row, int chunk0, int c0) {
    if constexpr (XOR) {
      col[0] = Tile<W>::offset(row, chunk0 + c0);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) col[j] = Tile<W>::offset(row, chunk0 + 2 * j + c0);
    }
  }
  FG_DEVICE RowWalk fresh() const {
    RowWalk r;
    if constexpr (XOR) r.col[0] = opaque(col[0]);
    else r = *this;
    return r;
  }
  FG_DEVICE fg_u32 at(int i, int kk) const {
    if constexpr (XOR) {
      return static_cast<fg_u32>(kk * 16 * RB + 128 * ((2 * i) >> 3)) + (col[0] ^ static_cast<fg_u32>(16 * ((2 * i) & 7)));
    } else {
      return static_cast<fg_u32>(kk * 16 * RB) + col[i];
    }
  }
};

// The four roles (KERNELS.md section 2 and the header of this file).
FG_DEVICE int lane_() { return static_cast<int>(threadIdx.x) & 31; }
template <int W>  // A (m x k) stored [m][k], rows from m0
FG_DEVICE KWalk<W> a_kwalk(int m0) { return KWalk<W>(m0 + (lane_() & 15), lane_() >> 4); }
template <int W>  // B (k x n) stored [n][k], rows from n0
FG_DEVICE KWalk<W> b_kwalk(int n0) { return KWalk<W>(n0 + ((lane_() >> 4) << 3) + (lane_() & 7), (lane_() >> 3) & 1); }
template <int W, int N>  // A (m x k) stored [k][m], columns from m0
FG_DEVICE RowWalk<W, N> a_rowwalk(int m0) {
  return RowWalk<W, N>(((lane_() >> 4) << 3) + (lane_() & 7), m0 / 8, (lane_() >> 3) & 1);
}
template <int W, int N>  // B (k x n) stored [k][n], columns from n0
FG_DEVICE RowWalk<W, N> b_rowwalk(int n0) { return RowWalk<W, N>(lane_() & 15, n0 / 8, lane_() >> 4); }

// acc (16*MT x 8*NT) += A B over k = 0 .. 16*KT with tabled addresses: A at
// shared address sA walked by `ao` (its first MT steps), B at sB by `bo` (its
// steps b0 .. b0 + NT/2 - 1; b0 a constant after unrolling).
template <int MT, int NT, int KT, bool BF16, typename AO, typename BO>
FG_DEVICE void warp_mma_t(float (&acc)[MT][NT][4], fg_u32 sA, const AO& ao_in, fg_u32 sB, const BO& bo_in,
                          int b0 = 0) {
  static_assert(NT % 2 == 0, "B fragments come in pairs of n8 tiles");
  sA = opaque(sA);
  sB = opaque(sB);
  const AO& ao = ao_in.fresh();
  const BO bo = bo_in.fresh();
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    fg_u32 a[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
      if constexpr (AO::TRANS) ldmatrix_x4_trans(a[mi], sA + ao.at(mi, kk));
      else ldmatrix_x4(a[mi], sA + ao.at(mi, kk));
    }
#pragma unroll
    for (int nj2 = 0; nj2 < NT / 2; ++nj2) {
      fg_u32 b[4];
      if constexpr (BO::TRANS) ldmatrix_x4_trans(b, sB + bo.at(b0 + nj2, kk));
      else ldmatrix_x4(b, sB + bo.at(b0 + nj2, kk));
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        mma_16816<BF16>(acc[mi][2 * nj2], a[mi], b[0], b[1]);
        mma_16816<BF16>(acc[mi][2 * nj2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Store an accumulator tile (rows from m0, columns from n0) into a Tile<W> as
// 16-bit values: one 4-byte store per pair of columns.
template <int W, int MT, int NT, bool BF16>
FG_DEVICE void store_acc_smem(fg_u32 s, const float (&acc)[MT][NT][4], int m0, int n0) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nj = 0; nj < NT; ++nj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const fg_u32 packed = pack2<BF16>(acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
        const fg_u32 addr = s + Tile<W>::offset(m0 + mi * 16 + g + 8 * h, n0 / 8 + nj) + 4 * t;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed));
      }
}

// Two 16-bit values of one register (low half: the lower column) back to fp32; exact.
template <bool BF16>
FG_DEVICE void unpack2(fg_u32 x, float& lo, float& hi) {
  if constexpr (BF16) {
    lo = __uint_as_float(x << 16);
    hi = __uint_as_float(x & 0xffff0000u);
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi) : "r"(x));
  }
}

// Store a tile of packed 16-bit pairs (pk[mi][nj][h]: row g + 8h of the mi-th
// 16-row slice, columns 2t, 2t+1 of the nj-th n8 tile; rows from m0, columns
// from n0) into a Tile<W>: the layout of store_acc_smem, already converted.
template <int W, int MT, int NT>
FG_DEVICE void store_pk_smem(fg_u32 s, const fg_u32 (&pk)[MT][NT][2], int m0, int n0) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int nj = 0; nj < NT; ++nj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const fg_u32 addr = s + Tile<W>::offset(m0 + mi * 16 + g + 8 * h, n0 / 8 + nj) + 4 * t;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pk[mi][nj][h]));
      }
}

// Store an accumulator tile, times `mul`, to a row-major global matrix (rows
// from row0 + m0, columns from n0); rows >= n_rows and columns >= d are skipped.
template <int MT, int NT, bool BF16>
FG_DEVICE void store_acc_global(elem_t* g_base, fg_i64 stride, const float (&acc)[MT][NT][4], int row0, int m0,
                                int n0, int n_rows, int d, float mul) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + m0 + mi * 16 + g + 8 * h;
      if (row >= n_rows) continue;
      elem_t* dst = g_base + static_cast<fg_i64>(row) * stride;
#pragma unroll
      for (int nj = 0; nj < NT; ++nj) {
        const int col = n0 + nj * 8 + 2 * t;
        if (col < d)
          *reinterpret_cast<fg_u32*>(dst + col) =
              pack2<BF16>(acc[mi][nj][2 * h] * mul, acc[mi][nj][2 * h + 1] * mul);
      }
    }
}

// ---- bwd_preprocess ------------------------------------------------------------
// D_i = rowsum(dO_i * O_i) is computed with the same instruction sequence as the
// dK/dV kernel's dP^T = V dO^T: m16n8k16 mma, the row of O as the A row, the row
// of dO as the B column, the k steps of 16 in ascending order from a zero
// accumulator. dS = P (dP - D) then has no rounding residue where a row of O
// equals a row of V (one visible key: P = 1, O = V, so dP - D is exactly 0 and
// dK exactly 0, as the exact gradient). Summed in another order, D and dP
// differ in the last bits and the residue, times Q and summed over the rows,
// is what the same-dtype reference (which gets 0) does not have.
// One warp per 16 rows at a time: A = O rows r0..r0+15; B = dO rows r0..r0+7
// (first mma) and r0+8..r0+15 (second); D sits on the diagonals: (g, g) of the
// first and (g+8, g) of the second, both held by the lane with t = g / 2.
template <int D, int ROWS, int NW, bool BF16, typename Params>
FG_DEVICE void bwd_preprocess_body(const Params& p) {
  static_assert(ROWS % 16 == 0, "16 rows per warp step");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const fg_i64 bh = static_cast<fg_i64>(b) * p.heads + h;
  const elem_t* o = p.o + b * p.o_sb + h * p.o_sh;
  const elem_t* dout = p.dout + b * p.dout_sb + h * p.dout_sh;
  const float LOG2E = 1.4426950408889634f;
  for (int r16 = warp * 16; r16 < ROWS; r16 += NW * 16) {
    const int ra = blockIdx.x * ROWS + r16 + g, rb = ra + 8;  // < nq_pad: the grid covers the padded rows
    const bool oka = ra < p.nq, okb = rb < p.nq;
    const elem_t* oa = o + static_cast<fg_i64>(oka ? ra : 0) * p.o_ss;
    const elem_t* ob = o + static_cast<fg_i64>(okb ? rb : 0) * p.o_ss;
    const elem_t* da = dout + static_cast<fg_i64>(oka ? ra : 0) * p.dout_ss;
    const elem_t* db = dout + static_cast<fg_i64>(okb ? rb : 0) * p.dout_ss;
    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int col = kk * 16 + 2 * t;  // even, and d is a multiple of 8: col < d covers col + 1
      const bool lo = col < p.d, hi = col + 8 < p.d;
      auto ld = [](const elem_t* row, bool ok, int c) -> fg_u32 {
        return ok ? *reinterpret_cast<const fg_u32*>(row + c) : 0u;
      };
      const fg_u32 a[4] = {ld(oa, oka && lo, col), ld(ob, okb && lo, col), ld(oa, oka && hi, col + 8),
                           ld(ob, okb && hi, col + 8)};
      mma_16816<BF16>(c0, a, ld(da, oka && lo, col), ld(da, oka && hi, col + 8));
      mma_16816<BF16>(c1, a, ld(db, okb && lo, col), ld(db, okb && hi, col + 8));
    }
    if (t == (g >> 1)) {
      const float dd[2] = {(g & 1) ? c0[1] : c0[0], (g & 1) ? c1[3] : c1[2]};
      const int rows[2] = {ra, rb};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = rows[i];
        float l2 = INFINITY, dsum = 0.f;  // padding rows (and rows that see no key) weigh nothing
        if (row < p.nq) {
          const float lse = p.lse[bh * p.nq + row];
          l2 = lse == -INFINITY ? INFINITY : lse * LOG2E;
          dsum = dd[i] - (p.dlse != nullptr ? p.dlse[bh * p.nq + row] : 0.f);
        }
        p.lse2[bh * p.nq_pad + row] = l2;
        p.dsum[bh * p.nq_pad + row] = dsum;
      }
    }
  }
  if (p.dq_acc != nullptr) {
    const int row0 = blockIdx.x * ROWS;
    const int rows = min(ROWS, p.nq - row0);
    float* z = p.dq_acc + (bh * p.nq + row0) * D;
    for (int i = threadIdx.x; i < rows * (D / 4); i += NW * 32)
      *reinterpret_cast<fg_u32x4*>(z + 4 * i) = fg_u32x4{0u, 0u, 0u, 0u};
  }
}

// ---- bwd_convert: dQ accumulator (b, h, nq, D) fp32 -> dq in the input dtype, times scale ----
template <int D, int ROWS, int NW, bool BF16, typename Params>
FG_DEVICE void bwd_convert_body(const Params& p) {
  constexpr int C = D / 8;
  const int b = blockIdx.z, h = blockIdx.y;
  const fg_i64 bh = static_cast<fg_i64>(b) * p.heads + h;
  elem_t* dq = p.dq + b * p.dq_sb + h * p.dq_sh;
  for (int i = threadIdx.x; i < ROWS * C; i += NW * 32) {
    const int row = blockIdx.x * ROWS + i / C, c = i % C;
    if (row >= p.nq || c * 8 >= p.d) continue;
    const float* src = p.dq_acc + (bh * p.nq + row) * D + c * 8;
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = src[j] * p.scale;
    fg_u32x4 out;
    out.x = pack2<BF16>(x[0], x[1]);
    out.y = pack2<BF16>(x[2], x[3]);
    out.z = pack2<BF16>(x[4], x[5]);
    out.w = pack2<BF16>(x[6], x[7]);
    *reinterpret_cast<fg_u32x4*>(dq + static_cast<fg_i64>(row) * p.dq_ss + c * 8) = out;
  }
}

// User mods with a block mask (V::SPARSE, common/mod.cuh): the query blocks of (batch b, query head hq)
// that see key block n_block, as (block << 1) | partial entries, and their count (BlockMask.for_key_tile).
// Templates: a kernel without mods, whose parameter block has no block mask fields, never compiles them.
template <typename Params>
FG_DEVICE const int* bwd_block_list(const Params& p, int b, int hq, int n_block, int& count) {
  const fg_i64 r = static_cast<fg_i64>(b) * p.bm_sb + static_cast<fg_i64>(hq) * p.bm_sh + n_block;
  count = __ldg(p.bm_count + r);
  return p.bm_index + r * p.bm_nb;
}

// The steps of a CTA under a block mask: (query head of the group, query block) pairs in the order of
// the group's heads and each list's entries (heads whose list is empty passed over): ``next`` gives the
// next step's query block (its flag in `partial`, its head in `qh`). bwd_sm90's producer and consumers, and
// bwd_dkdv's loads and steps, walk the same sequence each.
struct bwd_sparse_walk {
  const int* list;
  int qh, j, count;
  template <typename Params>
  FG_DEVICE int next(const Params& p, int b, int hk, int n_block, bool& partial) {
    while (j == count) {
      ++qh;
      j = 0;
      list = bwd_block_list(p, b, hk * p.group + qh, n_block, count);
    }
    const int e = __ldg(list + j++);
    partial = e & 1;
    return e >> 1;
  }
};

// The steps of all the group's lists together.
template <typename Params>
FG_DEVICE int bwd_sparse_steps(const Params& p, int b, int hk, int n_block) {
  int total = 0;
  for (int qh = 0; qh < p.group; ++qh) {
    int count;
    bwd_block_list(p, b, hk * p.group + qh, n_block, count);
    total += count;
  }
  return total;
}
