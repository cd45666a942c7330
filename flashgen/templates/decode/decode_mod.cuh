// User mods in decode_split (flashgen.mods; fg_score_mod and fg_mask_mod are printed before this header
// from the traced graphs, fg_mod_args carries their captured tensors, common/mod.cuh's row helpers call
// them): the decode_variant interface
// (decode_variant.cuh) with the score_mod applied to every score and the mask_mod on every block.
//
// Indices: b the sequence, h the query head of the packed row, q_idx the new token's position in its
// sequence (token i of nq is at i + diag, diag = len - nq: the bottom-right alignment decode has
// anyway), kv_idx the key's. So a mod written for a whole sequence's prefill (q_idx and kv_idx
// positions there too) means the same in decode. Decode stays causal: the kernel's own limits (the
// row's last key, the split's and the sequence's ends) apply first, then the mask_mod hides more.
// Scores: as in the forward (common/mod.cuh), the raw q.k times cap_in (the softmax's scale, with a
// constant factor on the score folded in) goes to fg_score_mod, and the softmax's scales carry the
// factor on its result (Variant.values). There is no block mask: a mask_mod is evaluated per score on
// every block, and no key block is skipped.
#pragma once

template <bool SCORE, bool MASK>
struct decode_mod_variant : decode_variant<false, false, false, false> {
  enum : int { WIN = 0, CAP = 0, SLOPES = 0, SINK = 0, TRANSFORMS = SCORE, MASK_ALL = MASK };
  int b_, hq[2], qi[2];
  const fg_mod_args* args;
  fg_mask_mod_head_t mask_head[2];  // MASK: the mask_mod's per-head values of each row half's head

  // This thread's rows r0 + g + 8 h: their query heads and positions (padded rows past p.rows get values
  // too: their heads stay within the KV head's group, and their results are never stored).
  template <typename Params>
  FG_DEVICE void set_rows(const Params& p, int b, int hk, int r0, int g, int diag, float) {
    b_ = b;
    args = &p.mod;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + g + 8 * h;
      hq[h] = head_of(p, hk, r);
      qi[h] = r / p.group + diag;
      if constexpr (MASK) mask_head[h] = fg_mask_mod_head(b, hq[h], p.mod);
    }
  }

  // The score_mod on row half h of S; c0 is the key of this thread's first column (common/mod.cuh).
  template <typename Params, typename F>
  FG_DEVICE void transform(const Params&, F& s, int h, int, int, int c0, float cap_in) const {
    fg_score_mod_row(s, h, b_, hq[h], qi[h], c0, cap_in, *args);
  }

  // The kernel's limit (keys at or past `hi`), then the mask_mod.
  template <typename Params, typename F>
  FG_DEVICE void mask(const Params& p, F& s, int h, int r, int diag, int c0, int hi) const {
    fg_mask_mod_row<MASK>(s, h, b_, hq[h], qi[h], c0, hi, *args, mask_head[h]);
  }
};
