// Flash-Decoding combine: merge the splits' partial outputs of each row
// (batch, token, query head) by their log-sum-exps,
//   lse = max + ln sum_i exp(lse_i - max),  O = sum_i exp(lse_i - lse) O_i.
// A split with LSE -inf (no keys) weighs nothing; a row whose splits are all
// -inf gets O = 0 and LSE -inf. D/4 threads share a row, one float4 each.
#pragma once

template <int D, int NW, bool BF16, typename Params>
FG_DEVICE void decode_combine_body(const Params& p) {
  constexpr int TPR = D / 4;               // threads per row
  constexpr int RPC = NW * 32 / TPR;       // rows per CTA
  static_assert(TPR <= NW * 32 && (NW * 32) % TPR == 0, "a row must fit in the CTA");
  const int c4 = threadIdx.x % TPR;
  const fg_i64 r = static_cast<fg_i64>(blockIdx.x) * RPC + threadIdx.x / TPR;
  if (r >= p.total_rows) return;
  const int S = p.num_splits;
  const float* lse_r = p.lse_ws + r;

  float m = -INFINITY;
  for (int s = 0; s < S; ++s) m = fmaxf(m, lse_r[s * p.total_rows]);
  float lse = -INFINITY;
  if (m != -INFINITY) {
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += expf(lse_r[s * p.total_rows] - m);
    lse = m + logf(sum);
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lse != -INFINITY && c4 * 4 < p.d) {
    const float* o_r = p.o_ws + r * p.d + c4 * 4;
    const fg_i64 o_step = p.total_rows * p.d;
#pragma unroll 4
    for (int s = 0; s < S; ++s) {
      const float l = lse_r[s * p.total_rows];
      const float4 x = *reinterpret_cast<const float4*>(o_r + s * o_step);
      // Select rather than branch: the loads of several splits stay in flight,
      // and an empty split's O never enters the sum (0 * garbage is not 0).
      const bool used = l != -INFINITY;
      const float w = used ? expf(l - lse) : 0.f;
      acc.x += used ? w * x.x : 0.f;
      acc.y += used ? w * x.y : 0.f;
      acc.z += used ? w * x.z : 0.f;
      acc.w += used ? w * x.w : 0.f;
    }
  }
  if (c4 * 4 < p.d) {
    uint2 packed;
    packed.x = pack2<BF16>(acc.x, acc.y);
    packed.y = pack2<BF16>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(p.o + r * p.d + c4 * 4) = packed;
  }
  if (p.lse != nullptr && c4 == 0) {
    // rows are (batch, token, head); the LSE is laid out (batch, head, token)
    const int h = static_cast<int>(r % p.heads_q);
    const fg_i64 bt = r / p.heads_q;
    const int tok = static_cast<int>(bt % p.nq);
    const fg_i64 b = bt / p.nq;
    p.lse[(b * p.heads_q + h) * p.nq + tok] = lse;
  }
}
