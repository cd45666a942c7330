// The variant interface of templates/common/variant.cuh for user mods (flashgen.mods): fg_score_mod
// changes each score, fg_mask_mod hides keys, and a block mask (flashgen.api.blockmask, made at the
// kernel's tile) lists each query block's key blocks. The two functions are emitted before this header
// from the traced graphs (the spec's ``mod`` token names the pair); fg_mod_args (mod_args.cuh) carries
// their captured tensors.
//
// Scores: score_mod takes the scaled score (FlexAttention's convention), so the transform multiplies the
// raw q.k by the softmax scale (the parameter block's cap_in) first, and the host runs the softmax in
// natural units (scale 1, scale_log2 = log2 e: Variant.values).
//
// Blocks (MASK): the parameter block's bm_count (Bm, Hm, m-blocks) and bm_index (Bm, Hm, m-blocks, bm_nb)
// give, per query block, how many key blocks it visits and which, ascending, each entry (block << 1) |
// partial. A batch or head the mask does not depend on has stride 0 (bm_sb, bm_sh, in m-block rows).
// Full blocks run without any mask but the key end's; partial ones call fg_mask_mod per score.
//
// The backward (bwd_sm90, key-outer) reads the same fields with the roles swapped: bm_count / bm_index
// per key block (rows of key blocks, entries (query block << 1) | partial: BlockMask.for_key_tile), and
// scores one element at a time (score). Its fg_score_mod is printed unfolded (cap_in is the softmax
// scale, the softmax runs in natural units) and, with GRAD, fg_score_mod_grad also gives d score_mod /
// d score, the factor of dS (dS_factor); without GRAD that factor is 1 (a mod that adds to the score).
#pragma once

// The derivative's function is printed only for a backward kernel whose score_mod has one; declared here
// so that the branch calling it compiles (unused) everywhere else.
__device__ float fg_score_mod_grad(float score, int b, int h, int q, int kv, const fg_mod_args& a, float& grad);
// Likewise the linear form's functions (LINEAR: flashgen.mods.linear), printed only for such a kernel.
__device__ float fg_score_mod_lin(float score, int b, int h, int q, int kv, const fg_mod_args& a);
__device__ float fg_score_mod_kv(float score, int b, int h, int q, int kv, const fg_mod_args& a);
__device__ float fg_score_mod_q(float score, int b, int h, int q, int kv, const fg_mod_args& a);

// The score_mod on row half hh of an accumulator fragment: query q of head h in batch b, this thread's
// first column c0; the raw score times `scale` is what the function takes.
template <typename F>
FG_DEVICE void fg_score_mod_row(F& s, int hh, int b, int h, int q, int c0, float scale, const fg_mod_args& a) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = frag<F>::at(s, nj, 2 * hh + e);
      x = fg_score_mod(x * scale, b, h, q, c0 + 8 * nj + e, a);
    }
}

// The keys at or past `limit`, and (MASK) those the mask_mod hides, of row half hh become -inf (indices as
// fg_score_mod_row's; k: fg_mask_mod_head(b, h, a), the mask's per-head values).
template <bool MASK, typename F>
FG_DEVICE void fg_mask_mod_row(F& s, int hh, int b, int h, int q, int c0, int limit, const fg_mod_args& a,
                               const fg_mask_mod_head_t& k) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = c0 + 8 * nj + e;
      bool seen = col < limit;
      if constexpr (MASK) seen = seen && fg_mask_mod(b, h, q, col, a, k);
      if (!seen) frag<F>::at(s, nj, 2 * hh + e) = -INFINITY;
    }
}

// ROWS (the forward families and bwd_sm90: KernelSpec.row_bounds): row q of batch b, head h sees exactly
// keys lo..hi, the parameter block's bm_rows pair at (b bm_rsb + h bm_rsh + q) (BlockMask.row_bounds: a mask
// whose rows each see one run of keys, lo > hi for none; hi < nk, so the key end needs no test of its own):
// a partial block is masked by two compares a score, with one 8-byte read per row half (the backward's
// score: per query row of its S^T), where the mask_mod would read its captures per score. Rows past nq
// read the last row's bounds (their results are not written).
template <typename F>
FG_DEVICE void fg_mask_bounds_row(F& s, int hh, int c0, int lo, int hi) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = c0 + 8 * nj + e;
      if (col < lo || col > hi) frag<F>::at(s, nj, 2 * hh + e) = -INFINITY;
    }
}

// LINEAR (fwd_sm90 only): the score_mod is x + a(b, h) kv + r(b, h, q) (flashgen.mods.linear: a is
// fg_score_mod_kv, r(q) fg_score_mod_lin at x = 0, kv = 0) and runs as the built-in causal ALiBi does
// (ALIBI_LINEAR): the scores stay raw q.k (the host sets the softmax's scales to the softmax scale's),
// transform_cols adds a / scale times the column's offset in the block with one FFMA per score, and
// alibi_row_offset gives the rest, (a c0 + r(q)) / scale. LINEAR_ROWS: r(q) = beta q + r(0) (beta is
// fg_score_mod_q), so the offset is two FMAs on values set once per head, with no call of r in the loop.
template <bool SCORE, bool MASK, bool GRAD = false, bool LINEAR = false, bool LINEAR_ROWS = false, bool ROWS = false>
struct fg_mod_variant {
  static_assert(!ROWS || MASK, "row bounds are a mask_mod's");
  enum : int { RIGHT = 0, LEFT = 0, TRANSFORMS = SCORE && !LINEAR, HAS_SINK = 0, HAS_CAP = 0, HAS_ALIBI = 0,
               PLAIN = 0, VARLEN_ROWS = 0, ALIBI_LINEAR = LINEAR, SPARSE = MASK, DS_FACTOR = SCORE && GRAD, USER = 1 };
  int nq, nk, diag, b, h, count;
  float scale;
  float col_slope, row_slope, row_const, inv_scale;  // LINEAR: a, beta, r(0) over the scale; 1 / scale
  const fg_mod_args* args;
  const int* row;  // MASK: this query block's entries of bm_index
  const int2* bounds;  // ROWS: this (batch, head)'s row bounds
  fg_mask_mod_head_t mask_head;  // MASK: the mask_mod's per-head values (reads at constant or (b, h) indices)

  FG_DEVICE fg_mod_variant() {}
  template <typename Params>
  FG_DEVICE explicit fg_mod_variant(const Params& p) {
    nq = p.nq;
    nk = p.nk;
    diag = p.nk - p.nq;
    scale = p.cap_in;
    args = &p.mod;
    b = h = count = 0;
    row = nullptr;
    bounds = nullptr;
    col_slope = row_slope = row_const = 0.f;
    inv_scale = LINEAR ? 1.f / scale : 1.f;
  }
  template <typename Params>
  FG_DEVICE void set_head(const Params& p, int b_, int hq) {
    b = b_;
    h = hq;
    if constexpr (LINEAR) col_slope = fg_score_mod_kv(0.f, b, h, 0, 0, *args) * inv_scale;
    if constexpr (LINEAR_ROWS) {
      row_slope = fg_score_mod_q(0.f, b, h, 0, 0, *args) * inv_scale;
      row_const = fg_score_mod_lin(0.f, b, h, 0, 0, *args) * inv_scale;
    }
    if constexpr (MASK && !ROWS) mask_head = fg_mask_mod_head(b, h, *args);
    if constexpr (ROWS)
      bounds = reinterpret_cast<const int2*>(p.bm_rows) + static_cast<fg_i64>(b) * p.bm_rsb +
               static_cast<fg_i64>(h) * p.bm_rsh;
  }
  // MASK: the block list of query block m_block of (b, h) (set_head first).
  template <typename Params>
  FG_DEVICE void set_block_row(const Params& p, int m_block) {
    if constexpr (MASK) {
      const fg_i64 r = static_cast<fg_i64>(b) * p.bm_sb + static_cast<fg_i64>(h) * p.bm_sh + m_block;
      count = p.bm_count[r];
      row = p.bm_index + r * p.bm_nb;
    }
  }
  FG_DEVICE int block_at(int j) const { return __ldg(row + j) >> 1; }
  FG_DEVICE bool partial_at(int j) const { return __ldg(row + j) & 1; }

  // Without a mask every row sees every key: the dense range.
  FG_DEVICE int block_first(int, int) const { return 0; }
  FG_DEVICE int block_end(int r0, int, int bn) const { return r0 >= nq ? 0 : ceil_div(nk, bn); }
  FG_DEVICE bool needs_mask(int n0, int bn, int, int) const { return n0 + bn > nk; }

  // Row half hh of S (row `row_`, this thread's first column c0).
  template <typename F>
  FG_DEVICE void transform(F& s, int hh, int row_, int c0) const {
    fg_score_mod_row(s, hh, b, h, row_, c0, scale, *args);
  }
  // ROWS: query row `row_`'s (first, last) visible key (rows past nq: the last row's).
  FG_DEVICE int2 bounds_of(int row_) const { return __ldg(bounds + min(row_, nq - 1)); }
  template <typename F>
  FG_DEVICE void mask(F& s, int hh, int row_, int c0) const {
    if constexpr (ROWS) {
      const int2 r = bounds_of(row_);
      fg_mask_bounds_row(s, hh, c0, r.x, r.y);
    } else {
      fg_mask_mod_row<MASK>(s, hh, b, h, row_, c0, nk, *args, mask_head);
    }
  }
  // The backward's walk: without a mask every query block sees every key block.
  FG_DEVICE int query_first(int, int) const { return 0; }
  FG_DEVICE int query_end(int, int, int bm) const { return ceil_div(nq, bm); }
  // One score of the backward's S (raw x of query `row`, key `key`): the score_mod's value (t_out: its
  // derivative, GRAD), and -inf where `masked` (a partial block, the key end, the rows past nq) hides it.
  // ROWS (bwd_sm90): the row's bounds instead of the mask_mod, as the forward's mask.
  FG_DEVICE float score(float x, int row, int key, bool masked, float& t_out) const {
    if constexpr (SCORE && GRAD)
      x = fg_score_mod_grad(x * scale, b, h, row, key, *args, t_out);
    else if constexpr (SCORE)
      x = fg_score_mod(x * scale, b, h, row, key, *args);
    if (masked) {
      bool seen = key < nk && row < nq;
      if constexpr (ROWS) {
        const int2 r = bounds_of(row);
        seen = seen && key >= r.x && key <= r.y;
      } else if constexpr (MASK) {
        seen = seen && fg_mask_mod(b, h, row, key, *args, mask_head);
      }
      if (!seen) x = -INFINITY;
    }
    return x;
  }
  FG_DEVICE static float dS_factor(float g) { return g; }

  template <typename F>
  FG_DEVICE void transform_cols(F& s, int hh) const {
    if constexpr (LINEAR) alibi_cols(s, hh, col_slope);
  }
  FG_DEVICE float alibi_row_offset(int row_, int c0) const {
    if constexpr (LINEAR_ROWS)
      return fmaf(col_slope, static_cast<float>(c0), fmaf(row_slope, static_cast<float>(row_), row_const));
    else if constexpr (LINEAR)
      return fmaf(col_slope, static_cast<float>(c0), fg_score_mod_lin(0.f, b, h, row_, 0, *args) * inv_scale);
    return 0.f;
  }
  // LINEAR's a / scale, the bias's growth per key (fwd_sm90's BIAS_GEMM: variant.cuh's col_slope_of).
  FG_DEVICE float col_slope_of() const { return LINEAR ? col_slope : 0.f; }
  FG_DEVICE void finish(float m, float l, float scale_, float& inv, float& lse) const {
    inv = row_inv(l);
    lse = row_lse(m, l, scale_);
  }
};
