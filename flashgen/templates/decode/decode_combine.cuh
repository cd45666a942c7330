// Flash-Decoding combine: merge the splits' partial outputs of each row
// (batch, token, query head) by their log-sum-exps (decode_merge.cuh, the same
// merge decode_split runs in-kernel). D/4 threads share a row, one float4 each.
#pragma once

template <int D, int NW, bool BF16, typename Params>
FG_DEVICE void decode_combine_body(const Params& p) {
  constexpr int TPR = D / 4;               // threads per row
  constexpr int RPC = NW * 32 / TPR;       // rows per CTA
  static_assert(TPR <= NW * 32 && (NW * 32) % TPR == 0, "a row must fit in the CTA");
  const int c4 = threadIdx.x % TPR;
  const fg_i64 r = static_cast<fg_i64>(blockIdx.x) * RPC + threadIdx.x / TPR;
  if (r >= p.total_rows || c4 * 4 >= p.d) return;  // (c4 = 0, which stores the LSE, is never past d)
  float4 acc;
  float lse;
  merge_splits(p.o_ws + r * p.d + c4 * 4, p.lse_ws + r, p.total_rows * p.d, p.total_rows, p.num_splits, -1,
               nullptr, nullptr, acc, lse);
  uint2 packed;
  packed.x = pack2<BF16>(acc.x, acc.y);
  packed.y = pack2<BF16>(acc.z, acc.w);
  *reinterpret_cast<uint2*>(p.o + r * p.d + c4 * 4) = packed;
  if (p.lse != nullptr && c4 == 0) {
    // rows are (batch, token, head); the LSE is laid out (batch, head, token)
    const int h = static_cast<int>(r % p.heads_q);
    const fg_i64 bt = r / p.heads_q;
    const int tok = static_cast<int>(bt % p.nq);
    const fg_i64 b = bt / p.nq;
    p.lse[(b * p.heads_q + h) * p.nq + tok] = lse;
  }
}
