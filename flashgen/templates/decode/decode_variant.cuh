// The variants in decode_split: a sliding window, softcap, ALiBi and learned sinks (flashgen/variants.py
// defines them; common/variant.cuh is the prefill kernels' side, whose tanh and range mask this reuses).
//
// Decode packs the query heads of one KV head into a CTA's rows: packed row r is new token tok = r / group
// of query head hk * group + r % group, and sees key j at offset o = j - (tok + diag), diag = len - nq
// (bottom-right alignment; decode is causal, o <= 0). So the per-head values (the ALiBi slope, the sink)
// are per row, and a thread, which holds rows g and g + 8 of the mma fragments (h = 0, 1), keeps two of
// each. What a switch adds:
//   WINDOW   (left, 0): row r sees keys [tok + diag - left, tok + diag]. The splits cover only
//            [first_key, len), first_key the first key the CTA's first row sees rounded down to a block,
//            so the kernel reads no K/V row (and no page) before the window; every block is masked
//            (mask_row_range: both bounds of each row).
//   SOFTCAP  the score becomes t = tanh(s cap_in), cap_in = scale / c; the host passes c as the scale and
//            c log2 e as scale_log2 (Variant.values), so that c t is the capped score with no multiply per
//            score (as in the prefill kernels).
//   ALIBI    -slope |o| joins the score, in the score's units: slope / (scale_log2 ln 2) (the softmax's
//            scale, or c with a softcap), after the softcap. (An FP8 cache's K descale is part of the
//            scale there, or of cap_in: the kernel's scores are q . k8, decode_split.cuh.)
//   SINKS    exp(sink) joins the row's softmax denominator once: in the epilogue when one split does the
//            whole row, else in the merge of the splits (merge_splits); a split's partial LSE has none.
// Plain decode (every switch off) compiles to the code it had before the variants existed: every
// addition is behind `if constexpr`, and first_key is the constant 0.
#pragma once

template <bool WINDOW, bool SOFTCAP, bool ALIBI, bool SINKS>
struct decode_variant {
  // (MASK_ALL: every block is masked, not only those the causal edge or a split's end crosses.)
  enum : int { WIN = WINDOW, CAP = SOFTCAP, SLOPES = ALIBI, SINK = SINKS, TRANSFORMS = SOFTCAP || ALIBI,
               MASK_ALL = WINDOW };
  float slope[2];   // ALIBI: row half h's slope over the score's unit

  // The query head of packed row r.
  template <typename Params>
  FG_DEVICE static int head_of(const Params& p, int hk, int r) { return hk * p.group + r % p.group; }

  // The first key the splits of the CTA whose first packed row is r0 cover: 0 without a window, else
  // the first key row r0 sees (the smallest lower bound of the CTA), rounded down to a block of BN.
  template <int BN, typename Params>
  FG_DEVICE static int first_key(const Params& p, int r0, int diag) {
    if constexpr (WINDOW) return max(0, r0 / p.group + diag - p.win_left) / BN * BN;
    return 0;
  }

  // This thread's rows: r0 + g + 8 h (padded rows past p.rows get values too; their results are never
  // stored, and their head index stays within the KV head's group). `scale_log2`: the softmax's factor
  // on the kernel's scores (p.scale_log2, times the K descale for an FP8 cache).
  template <typename Params>
  FG_DEVICE void set_rows(const Params& p, int b, int hk, int r0, int g, int diag, float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + g + 8 * h;
      if constexpr (ALIBI) {
        slope[h] = p.alibi[static_cast<fg_i64>(b) * p.alibi_sb + head_of(p, hk, r)] /
                   (scale_log2 * 0.6931471805599453f);
      }
    }
  }

  // Softcap, then ALiBi, on row half h (packed row r) of S; c0 is the key of this thread's first column.
  // (The row's diagonal key r / group + diag is recomputed per call, not kept: as two registers across
  // the block loop they made the n64 tile spill.)
  template <typename Params, typename F>
  FG_DEVICE void transform(const Params& p, F& s, int h, int r, int diag, int c0, float cap_in) const {
    if constexpr (SOFTCAP) softcap_row(s, h, cap_in);
    if constexpr (ALIBI) alibi_row(s, h, static_cast<float>(c0 - (r / p.group + diag)), slope[h]);  // o at c0
  }

  // Row half h (packed row r) of S: keys at or past `hi` (the row's causal and split limit) become -inf,
  // and with a window those before the row's first key; c0 as for transform. (The first key is
  // recomputed per call, not kept: as a register across the block loop it made the n64 tile spill.)
  template <typename Params, typename F>
  FG_DEVICE static void mask(const Params& p, F& s, int h, int r, int diag, int c0, int hi) {
    if constexpr (WINDOW)
      mask_row_range(s, h, r / p.group + diag - p.win_left - c0, hi - c0);
    else
      mask_row(s, h, hi - c0);
  }

  // The end of a row that one split covers whole, with its sink: m_all the row's (unscaled) max and
  // l_all its sum over every warp, `own` this warp's weight exp2((m_w - m_all) scale_log2). The factor
  // of this warp's O and the row's LSE (natural units): exp(sink) joins l_all under the larger of the
  // two maxima; a row that saw no key gets 0 and LSE = sink.
  FG_DEVICE static void finish_sink(float m_all, float l_all, float scale, float sink, float own, float& f,
                                    float& lse) {
    const float mn = l_all > 0.f ? m_all * scale : -INFINITY;
    const float top = fmaxf(mn, sink);
    const float a = __expf(mn - top);
    const float total = l_all * a + __expf(sink - top);
    f = own * a / total;
    lse = top + logf(total);
  }
};
