// The variant interface: which keys a query row sees (causal, sliding window), what happens to a score
// before the softmax (softcap, ALiBi) and what joins the softmax denominator (learned sinks), written
// once for every family (flashgen/variants.py holds the same definitions for the host, the reference and
// the docs).
//
// Query row i and key j are o = j - (i + diag) apart, diag = nk - nq (bottom-right alignment). A window
// (left, right) shows key j to row i iff -left <= o <= right; the host encodes an unbounded side as a
// bound no row reaches (left = nk, right = nq) and a causal call's right side as 0. A kernel that is
// neither causal nor windowed tests only the key end; one that is causal but not windowed uses right = 0
// as a constant, so its code is what it was before the window existed.
//
// Scores are held in the units of the softmax's scale (it multiplies by scale log2 e inside its exp2 and
// by scale for the LSE), so the transforms work in those units. Softcap c: the score becomes
// t = tanh(s cap_in) with cap_in = scale / c, and the host passes c log2 e as scale_log2 (and, to the
// forward, c as the scale of its LSE), so that t times the scale is c tanh(scale s / c) with no multiply
// per score. The ALiBi slope m is divided by the unit in use (scale_log2 ln 2: the softmax's scale, or
// c). A sink (natural units) joins at the end of the row (finish). The backward kernels keep t: the
// capped score's derivative is scale (1 - t^2), so dS picks up 1 - t^2 (dS_factor) and the softmax scale
// (their parameter block's scale stays the softmax's) as before.
//
// The tanh is tanh.approx.f32 (relative error about 2^-11). Two scores at a time in half precision
// (tanh.approx.f16x2, one MUFU issue for two) measured no faster on the H200 (softcap 50, d = 128, N = 8k:
// 0.68 and 0.70 of the plain kernel, causal and not, against 0.71-0.72 and 0.72-0.73 with f32) and rounds
// the input too: docs/perf/variants.md.
//
// One object per (batch, head), or per (sequence, head) with packed rows (VARLEN: set_lengths): fwd_sm90, fwd_v2 (and later the backward and decode kernels) construct it
// from their parameter block (win_left, win_right, cap_in, cap_out, alibi, alibi_sb, sinks) and call:
//   block_first / block_end   the key blocks a group of query rows visits
//   needs_mask                whether a key block crosses a row's visible range (a boundary block)
//   mask                      hide what one row half does not see (-inf)
//   transform                 softcap, then ALiBi, on one row half of S (every block)
//   transform_cols            the same, with causal ALiBi's row part left to alibi_row_offset (fwd_sm90)
//   col_slope_of              causal ALiBi's slope per key (fwd_sm90's bias GEMM adds the column part)
//
// (A softcapped kernel's parameter block carries scale = c: see the host's Variant.values.)
//   finish                    1 / l and the LSE of a row, with the sink in the denominator
// and, for the key-outer backward kernels, query_first / query_end (the query blocks a key block is
// seen by); score (one element: transform and mask) and, where DS_FACTOR, dS_factor (the softcap's
// 1 - t^2) of the value score leaves in t_out.
#pragma once

// Columns of row half h outside [lo, hi), counted from this thread's first column (as mask_row).
template <typename F>
FG_DEVICE void mask_row_range(F& s, int h, int lo, int hi) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (nj * 8 + e >= hi || nj * 8 + e < lo) frag<F>::at(s, nj, 2 * h + e) = -INFINITY;
}

// The score transforms on row half h of S, shared by fg_variant and the decode kernel's variant: the
// softcap's t = tanh(s cap_in), and ALiBi's -slope |o| with o = base at this thread's first column.
template <typename F>
FG_DEVICE void softcap_row(F& s, int h, float cap_in) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = frag<F>::at(s, nj, 2 * h + e);
      x = fast_tanh(x * cap_in);
    }
}
template <typename F>
FG_DEVICE void alibi_row(F& s, int h, float base, float slope) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = frag<F>::at(s, nj, 2 * h + e);
      x = fmaf(-slope, fabsf(base + static_cast<float>(8 * nj + e)), x);
    }
}

// ALiBi where every visible key has o <= 0 (causal, no window), on row half h of S: only the column
// part slope * (8 nj + e) of -slope |o| = slope o (one FFMA with an immediate per score, against an add
// and an FFMA with |.| for alibi_row). The rest, slope * (c0 - row - diag), is the same for all of a
// thread's columns of one row in one block: the caller adds it to that row's block max and folds it into
// the exp2's offset (fg_variant::alibi_row_offset), so the softmax sees the same scores.
template <typename F>
FG_DEVICE void alibi_cols(F& s, int h, float slope) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = frag<F>::at(s, nj, 2 * h + e);
      x = fmaf(slope, static_cast<float>(8 * nj + e), x);
    }
}

template <bool CAUSAL, bool WINDOW, bool SOFTCAP, bool ALIBI, bool SINKS, bool VARLEN = false>
struct fg_variant {
  enum : int { RIGHT = CAUSAL || WINDOW, LEFT = WINDOW, TRANSFORMS = SOFTCAP || ALIBI, HAS_SINK = SINKS,
               HAS_CAP = SOFTCAP, HAS_ALIBI = ALIBI, PLAIN = !(WINDOW || SOFTCAP || ALIBI || SINKS),
               VARLEN_ROWS = VARLEN, ALIBI_LINEAR = ALIBI && CAUSAL && !WINDOW,
               SPARSE = 0 /* key blocks from a block mask's list: common/mod.cuh */,
               DS_FACTOR = SOFTCAP /* the backward's dS takes dS_factor of score's t_out */,
               USER = 0 /* user mods (common/mod.cuh) */ };
  int nq, nk, diag, left, right;
  float cap_in, slope, sink;

  FG_DEVICE fg_variant() {}
  template <typename Params>
  FG_DEVICE explicit fg_variant(const Params& p) {
    nq = p.nq;
    nk = p.nk;
    diag = p.nk - p.nq;
    left = WINDOW ? p.win_left : 0;
    right = WINDOW ? p.win_right : 0;
    cap_in = SOFTCAP ? p.cap_in : 0.f;
    slope = 0.f;
    sink = 0.f;
  }
  // Packed rows (VARLEN, common/varlen.cuh): the lengths of the current sequence (the parameter block's
  // nq, nk are the packed totals there).
  FG_DEVICE void set_lengths(int q_len, int k_len) {
    nq = q_len;
    nk = k_len;
    diag = k_len - q_len;
  }
  // The per-(batch, head) values: the ALiBi slope (over the scale) and the head's sink.
  template <typename Params>
  FG_DEVICE void set_head(const Params& p, int b, int hq) {
    if constexpr (ALIBI) slope = p.alibi[static_cast<fg_i64>(b) * p.alibi_sb + hq] / (p.scale_log2 * 0.6931471805599453f);
    if constexpr (SINKS) sink = p.sinks[hq];
  }

  // Row i sees keys [key_lo(i), key_hi(i)) (clipped to [0, nk); empty when lo >= hi).
  FG_DEVICE int key_hi(int row) const {
    if constexpr (RIGHT) return min(nk, row + diag + (WINDOW ? right : 0) + 1);
    return nk;
  }
  FG_DEVICE int key_lo(int row) const {
    if constexpr (LEFT) return max(0, row + diag - left);
    return 0;
  }
  // The first key block (of bn keys) that rows from r0 on see; 0 without a left bound.
  FG_DEVICE int block_first(int r0, int bn) const {
    if constexpr (LEFT) return key_lo(r0) / bn;
    return 0;
  }
  // One past the last key block rows [r0, r0 + rows) see (rows past nq count not); 0 when none.
  FG_DEVICE int block_end(int r0, int rows, int bn) const {
    if (r0 >= nq) return 0;
    const int hi = key_hi(min(r0 + rows, nq) - 1);
    return hi <= 0 ? 0 : ceil_div(hi, bn);
  }
  // Whether key block [n0, n0 + bn) holds a key past nk or one that some row of [r0, r1] does not see.
  FG_DEVICE bool needs_mask(int n0, int bn, int r0, int r1) const {
    bool m = n0 + bn > nk;
    if constexpr (RIGHT) m = m || (n0 + bn - 1 > r0 + diag + (WINDOW ? right : 0));
    if constexpr (LEFT) m = m || (n0 < r1 + diag - left);
    return m;
  }
  // Row half h of S (row `row`, this thread's first column c0): what the row does not see becomes -inf.
  template <typename F>
  FG_DEVICE void mask(F& s, int h, int row, int c0) const {
    if constexpr (LEFT)
      mask_row_range(s, h, key_lo(row) - c0, key_hi(row) - c0);
    else
      mask_row(s, h, key_hi(row) - c0);
  }
  // Softcap, then ALiBi, on row half h of S (in the scale's units; see the top of this file).
  template <typename F>
  FG_DEVICE void transform(F& s, int h, int row, int c0) const {
    if constexpr (SOFTCAP) softcap_row(s, h, cap_in);
    if constexpr (ALIBI) alibi_row(s, h, static_cast<float>(c0 - row - diag), slope);  // o at the first column
  }
  // ALIBI_LINEAR's split of transform: transform_cols leaves out slope * (c0 - row - diag), which
  // alibi_row_offset returns (0 for every other variant); the score is the sum of the two.
  template <typename F>
  FG_DEVICE void transform_cols(F& s, int h) const {
    if constexpr (SOFTCAP) softcap_row(s, h, cap_in);
    if constexpr (ALIBI_LINEAR) alibi_cols(s, h, slope);
  }
  FG_DEVICE float alibi_row_offset(int row, int c0) const {
    if constexpr (ALIBI_LINEAR) return slope * static_cast<float>(c0 - row - diag);
    return 0.f;
  }
  // ALIBI_LINEAR's column slope: the bias grows by it per key (fwd_sm90's BIAS_GEMM puts it in S's GEMM and
  // calls alibi_row_offset with the block's first key for c0).
  FG_DEVICE float col_slope_of() const { return ALIBI_LINEAR ? slope : 0.f; }
  // The query blocks (of bm rows; m_blocks in all) that see some key of block [n0, n0 + bn): [first, end).
  FG_DEVICE int query_first(int n0, int bm) const {
    if constexpr (RIGHT) return min(ceil_div(nq, bm), max(0, n0 - diag - (WINDOW ? right : 0)) / bm);
    return 0;
  }
  FG_DEVICE int query_end(int n0, int bn, int bm) const {
    const int m_blocks = ceil_div(nq, bm);
    if constexpr (LEFT) {
      const int last = n0 + bn - 1 - diag + left;  // the last row that sees key n0 + bn - 1
      return last < 0 ? 0 : min(m_blocks, last / bm + 1);
    }
    return m_blocks;
  }
  // Whether row `row` sees key `key` (key < nk included).
  FG_DEVICE bool sees(int row, int key) const {
    bool in = key < nk;
    if constexpr (RIGHT) in = in && key <= row + diag + (WINDOW ? right : 0);
    if constexpr (LEFT) in = in && key >= row + diag - left;
    return in;
  }
  // One score of the backward's S (raw x of query `row`, key `key`): transformed, and -inf where hidden
  // (tested only when `masked`, a boundary block). SOFTCAP: t, the tanh value (dS_factor's argument), in
  // t_out.
  FG_DEVICE float score(float x, int row, int key, bool masked, float& t_out) const {
    if constexpr (SOFTCAP) {
      x = fast_tanh(x * cap_in);
      t_out = x;
    }
    if constexpr (ALIBI) x = fmaf(-slope, fabsf(static_cast<float>(key - row - diag)), x);
    if (masked && !sees(row, key)) x = -INFINITY;
    return x;
  }
  // What dS = P (dP - D) is multiplied by for the raw score: the softcap's 1 - t^2 (1 without one).
  FG_DEVICE static float dS_factor(float t) { return SOFTCAP ? fmaf(-t, t, 1.f) : 1.f; }

  // The end of a row: m its (unscaled) max, l its quad-summed row sum. 1 / l and the LSE (natural
  // units); with a sink, exp(sink) joins l under the larger of the two maxima, and a row that saw no
  // key gives 0 and LSE = sink.
  FG_DEVICE void finish(float m, float l, float scale, float& inv, float& lse) const {
    if constexpr (SINKS) {
      const float mn = l > 0.f ? m * scale : -INFINITY;
      const float top = fmaxf(mn, sink);
      const float a = __expf(mn - top);
      const float total = l * a + __expf(sink - top);
      inv = a / total;
      lse = top + logf(total);
    } else {
      inv = row_inv(l);
      lse = row_lse(m, l, scale);
    }
  }
};
