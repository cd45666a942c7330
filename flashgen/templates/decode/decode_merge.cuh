// The exact merge of Flash-Decoding's splits, shared by decode_split's in-kernel merge and the
// decode_combine kernel: per (row, 4 columns) item, the splits' partial outputs weighted by their
// log-sum-exps, lse = max + ln sum_s exp(lse_s - max), O = sum_s exp(lse_s - lse) O_s. A split with
// LSE -inf (no keys) weighs nothing; an item whose splits are all -inf gets O = 0 and LSE -inf. With
// SINK (decode_split's sinks; decode_combine has none), exp(sink) joins the sum once, after the splits
// and bringing no value: such an item gets O = 0 and LSE = sink.
#pragma once

// A GPU-coherent 16-byte load through a generic address: another CTA's partial (global, from L2) or
// the merger's own (shared memory), one instruction either way.
FG_DEVICE float4 ld_relaxed_f4(const float* ptr) {
  float4 v;
  asm volatile("ld.relaxed.gpu.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(ptr));
  return v;
}
FG_DEVICE float ld_relaxed_f1(const float* ptr) {
  float v;
  asm volatile("ld.relaxed.gpu.f32 %0, [%1];\n" : "=f"(v) : "l"(ptr));
  return v;
}

// One (row, 4 columns) item of the split merge: split s's partial O and LSE at o_r + s * o_step and
// l_r + s * l_step, except split `own_split`'s, at `own` and `own_l` (decode_split's merger: its own
// partial, in shared memory; generic addresses, so the loads stay one unconditional batch; -1: none).
// CH splits per chunk: the chunk's loads are independent (one L2 round trip), and a running max
// rescales what is summed so far (as the online softmax), so the row's LSE needs no pass of its own:
// O = sum_s e^(lse_s - m) O_s / sum_s e^(lse_s - m), LSE = m + ln(sum_s e^(lse_s - m)), in base 2 inside.
// Split indices past the last are clamped (a valid address) and weighted 0. The splits are summed in
// index order whichever one merges, so the result is the same bits every time (graph replays, reruns).
template <int CH, bool SINK>
FG_DEVICE void merge_item(const float* o_r, const float* l_r, fg_i64 o_step, fg_i64 l_step, int num_splits,
                          int own_split, const float* own, const float* own_l, float4& out, float& lse,
                          float sink) {
  constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
  float m = -INFINITY, sum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < num_splits; s0 += CH) {
    float ls[CH];
    float4 xs[CH];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int s = min(s0 + k, num_splits - 1);
      xs[k] = ld_relaxed_f4(s == own_split ? own : o_r + s * o_step);
      ls[k] = ld_relaxed_f1(s == own_split ? own_l : l_r + s * l_step) * LOG2E;
    }
    float mc = m;
#pragma unroll
    for (int k = 0; k < CH; ++k) mc = fmaxf(mc, s0 + k < num_splits ? ls[k] : -INFINITY);
    // No branch on an all-empty chunk (it would let ptxas sink the O loads behind the max): with
    // mc = -inf every weight is 0 through `used`, and the reference 0 keeps the exponents finite.
    const float mref = mc == -INFINITY ? 0.f : mc;
    const float a = fast_exp2(m - mref);  // 0 while m is -inf
    sum *= a;
    acc.x *= a; acc.y *= a; acc.z *= a; acc.w *= a;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      // Select, not branch: an empty split's O never enters the sum (0 * garbage is not 0).
      const bool used = s0 + k < num_splits && ls[k] != -INFINITY;
      const float w = used ? fast_exp2(ls[k] - mref) : 0.f;
      sum += w;
      acc.x += used ? w * xs[k].x : 0.f;
      acc.y += used ? w * xs[k].y : 0.f;
      acc.z += used ? w * xs[k].z : 0.f;
      acc.w += used ? w * xs[k].w : 0.f;
    }
    m = mc;
  }
  if constexpr (SINK) {  // the sink's term, under the larger of the two maxima (m = -inf: it is all there is)
    const float s2 = sink * LOG2E;
    const float top = fmaxf(m, s2);
    const float a = fast_exp2(m - top);
    sum = sum * a + fast_exp2(s2 - top);
    acc.x *= a; acc.y *= a; acc.z *= a; acc.w *= a;
    m = top;
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  out = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  lse = sum > 0.f ? (m + log2f(sum)) * LN2 : -INFINITY;
}

// merge_item with chunks of 4, 8 or 16 splits: no more loads and exponentials than the split count needs.
// SINK: `sink` (natural units) joins the sum (see the top of this file).
template <bool SINK = false>
FG_DEVICE void merge_splits(const float* o_r, const float* l_r, fg_i64 o_step, fg_i64 l_step, int num_splits,
                            int own_split, const float* own, const float* own_l, float4& out, float& lse,
                            float sink = 0.f) {
  if (num_splits <= 4) {
    merge_item<4, SINK>(o_r, l_r, o_step, l_step, num_splits, own_split, own, own_l, out, lse, sink);
  } else if (num_splits <= 8) {
    merge_item<8, SINK>(o_r, l_r, o_step, l_step, num_splits, own_split, own, own_l, out, lse, sink);
  } else {
    merge_item<16, SINK>(o_r, l_r, o_step, l_step, num_splits, own_split, own, own_l, out, lse, sink);
  }
}
