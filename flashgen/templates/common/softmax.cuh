// The online softmax as named row operations on mma accumulator fragments, written once for every
// forward family (fwd_v2, fwd_v1, fwd_sm90, decode_split).
//
// A fragment is one 16-row slice of S (or of O) in the m16n8 accumulator layout: n8 chunks of four
// floats, element 2h + e of chunk nj in row g + 8h (g = lane / 4) and column 8 nj + 2t + e (t = lane % 4).
// So a thread holds two rows, h = 0 and h = 1 ("row halves"), and each of the four lanes of a quad holds
// two columns of every chunk. Two storage shapes, the same layout: float[N8][4] (the mma.sync families)
// and float[4 N8] (a wgmma accumulator list). Everything is inlined with constant indices (every loop is
// unrolled), so the registers and the arithmetic are those of the loops written out in place.
//
// One online-softmax step for row half h of a block of S (softmax_step below), with m the running max
// (unscaled) and l the thread's partial row sum:
//   mx = quad_max(fold_row_max(s, h, m))       the new max, over the row's columns and the quad's lanes
//   ms = max_scaled(mx, scale_log2)            mx in exp2 units; 0 while the row has seen only -inf
//   alpha = rescale_factor(m, ms, scale_log2)  exp2((m - mx) scale_log2): what O and l are rescaled by
//   l = l alpha + exp2_row(s, h, ...)          P = exp2(s scale_log2 - ms) in place, and its row sum
//   rescale_row(o, h, alpha)
// and at the end l = quad_sum(l), O / l (row_inv) and the LSE (row_lse); mask_row before the step and
// p_frag after it (P as mma A fragments) are the same in every family too. fwd_v2, fwd_v1 and
// decode_split call softmax_step; fwd_sm90 calls the single operations, because its step differs.
//
// Not here, because their arithmetic or its order differs: fwd_sm90's lean softmax (two partial sums,
// a conditional max), its exp2 on the FMA pipe, and its O rescale (both rows in
// one pass after the step: the same multiplies in another order, which the compiler schedules
// differently), all in fwd_sm90.cuh; the standard kernel's softmax pass (a lane-wise running max over
// 8-element chunks merged by a butterfly over the warp: standard.cuh); the backward kernels, which
// recompute P from the LSE with no running max (bwd_dq.cuh, bwd_dkdv.cuh, bwd_sm90.cuh); the merge of
// per-warp or per-split partial results (decode_split.cuh, decode_merge.cuh).
#pragma once

// Element k (= 2h + e) of n8 chunk nj, for both storage shapes. (N8 is an enumerator, not a static
// constexpr member: NVRTC emits such a member as a global object into the cubin.)
template <typename F>
struct frag;
template <int N8_>
struct frag<float[N8_][4]> {
  enum { N8 = N8_ };
  static FG_DEVICE float& at(float (&f)[N8_][4], int nj, int k) { return f[nj][k]; }
};
template <int N>
struct frag<float[N]> {
  static_assert(N % 4 == 0, "an accumulator list holds whole n8 chunks");
  enum { N8 = N / 4 };
  static FG_DEVICE float& at(float (&f)[N], int nj, int k) { return f[4 * nj + k]; }
};

// The columns of row half h at or past `limit`, counted from this thread's first column (so column
// 8 nj + 2t + e is masked where 8 nj + e >= limit), become -inf: one compare per element against one
// per-row bound, no row or column indices built.
template <typename F>
FG_DEVICE void mask_row(F& s, int h, int limit) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (nj * 8 + e >= limit) frag<F>::at(s, nj, 2 * h + e) = -INFINITY;
}

// m folded with every column of row half h that this thread holds: a chain, one pair per chunk.
template <typename F>
FG_DEVICE float fold_row_max(F& s, int h, float m) {
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
    m = fmaxf(m, fmaxf(frag<F>::at(s, nj, 2 * h), frag<F>::at(s, nj, 2 * h + 1)));
  return m;
}

// The same maximum as a tree: the same 2 N8 max instructions, a dependent path of ~log2(N8) + 2
// instead of N8 + 1 (the max is exact in any order). fwd_sm90 takes it at d = 64 and with its lean
// softmax, where the short GEMMs leave the chain's latency on the softmax's path (docs/perf/fp8.md).
template <typename F>
FG_DEVICE float tree_row_max(F& s, int h, float m) {
  enum { N8 = frag<F>::N8 };
  float v[N8];
#pragma unroll
  for (int nj = 0; nj < N8; ++nj) v[nj] = fmaxf(frag<F>::at(s, nj, 2 * h), frag<F>::at(s, nj, 2 * h + 1));
#pragma unroll
  for (int w = 1; w < N8; w *= 2)
#pragma unroll
    for (int i = 0; i + w < N8; i += 2 * w) v[i] = fmaxf(v[i], v[i + w]);
  return fmaxf(m, v[0]);
}

// A row that has seen only masked keys keeps max -inf: use 0 so that exp2(-inf - 0) = 0 instead of NaN.
FG_DEVICE float max_scaled(float mx, float scale_log2) { return (mx == -INFINITY ? 0.f : mx) * scale_log2; }

// The factor by which O and l, accumulated under the old max m_old, are rescaled to the new one
// (m_scaled = max_scaled(new max)): 0 while m_old is -inf (O and l are 0 then).
FG_DEVICE float rescale_factor(float m_old, float m_scaled, float scale_log2) {
  return fast_exp2(m_old * scale_log2 - m_scaled);
}

// P = exp2(s scale_log2 - m_scaled) in place for row half h; returns this thread's sum of them (a chain).
template <typename F>
FG_DEVICE float exp2_row(F& s, int h, float scale_log2, float m_scaled) {
  float sum = 0.f;
#pragma unroll
  for (int nj = 0; nj < frag<F>::N8; ++nj)
#pragma unroll
    for (int e = 2 * h; e < 2 * h + 2; ++e) {
      const float pe = fast_exp2(fmaf(frag<F>::at(s, nj, e), scale_log2, -m_scaled));
      frag<F>::at(s, nj, e) = pe;
      sum += pe;
    }
  return sum;
}

// Row half h of O times alpha.
template <typename F>
FG_DEVICE void rescale_row(F& o, int h, float alpha) {
#pragma unroll
  for (int dj = 0; dj < frag<F>::N8; ++dj) {
    frag<F>::at(o, dj, 2 * h) *= alpha;
    frag<F>::at(o, dj, 2 * h + 1) *= alpha;
  }
}

// One online-softmax step for row half h (see the top of this file): s becomes P, m the new max, l the
// rescaled partial sum plus P's, O is rescaled. l stays per thread; it is quad-summed at the end.
template <typename FS, typename FO>
FG_DEVICE void softmax_step(FS& s, FO& o, int h, float& m, float& l, float scale_log2) {
  const float mx = quad_max(fold_row_max(s, h, m));
  const float m_scaled = max_scaled(mx, scale_log2);
  const float alpha = rescale_factor(m, m_scaled, scale_log2);
  m = mx;
  const float sum = exp2_row(s, h, scale_log2, m_scaled);
  l = l * alpha + sum;
  rescale_row(o, h, alpha);
}

// The end of the row: 1 / l for O (0 for a row that saw no key), and the LSE in natural-log units
// (m the unscaled max, `scale` the softmax scale; -inf for a row that saw no key). l quad-summed first.
FG_DEVICE float row_inv(float l) { return l > 0.f ? 1.f / l : 0.f; }
FG_DEVICE float row_lse(float m, float l, float scale) { return l > 0.f ? m * scale + logf(l) : -INFINITY; }

// P (fp32, in S's fragment) as the A fragment of k16 step kk of P V: n8 chunks 2kk and 2kk + 1.
template <bool BF16, typename F>
FG_DEVICE void p_frag(fg_u32 (&a)[4], F& s, int kk) {
  a[0] = pack2<BF16>(frag<F>::at(s, 2 * kk, 0), frag<F>::at(s, 2 * kk, 1));
  a[1] = pack2<BF16>(frag<F>::at(s, 2 * kk, 2), frag<F>::at(s, 2 * kk, 3));
  a[2] = pack2<BF16>(frag<F>::at(s, 2 * kk + 1, 0), frag<F>::at(s, 2 * kk + 1, 1));
  a[3] = pack2<BF16>(frag<F>::at(s, 2 * kk + 1, 2), frag<F>::at(s, 2 * kk + 1, 3));
}
