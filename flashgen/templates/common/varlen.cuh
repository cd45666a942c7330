// Packed rows (varlen): a call's sequences laid end to end in q (total_q rows) and k, v (total_k rows).
// Sequence s owns query rows [cu_q[s], cu_q[s + 1]) and the keys [cu_k[s], cu_k[s] + nk) with
// nk = used_k[s] where the caller gave seqused_k, else cu_k[s + 1] - cu_k[s] (a paged K/V cache: keys
// [0, nk) through the sequence's block-table row, fwd_sm90's PAGE_ROWS). Inside a sequence
// everything is as for one (batch, head) of a rectangular call: the variant (common/variant.cuh) is
// set to the sequence's lengths, so causal alignment, windows and the key end are per sequence.
//
// The work list. No tile is spent on padding: the host cannot know the lengths without a device
// sync, so a one-CTA kernel (fg_varlen_tiles, the module's `_tiles` entry, launched just before the
// attention kernel on the same stream) lists every (sequence, block) pair once (query blocks for the
// forward and bwd_dq, key blocks for the dK/dV kernels), most work first
// (a counting sort on the block's cost: the long causal rows start first and the short tiles fill the
// tail), into p.vl_tiles: [0] the pair count, [1] unused, then (sequence, block) int pairs. The kernel
// takes tile t as pair t / heads, head t % heads (the heads of one pair run side by side: under GQA
// they share their K/V), and the tiles number count x heads. Pairs of equal cost land in the order
// their atomics come (the attention of each tile does not depend on it).
#pragma once

struct fg_seq {
  int q_off, k_off, nq, nk;
};

template <typename Params>
FG_DEVICE fg_seq fg_seq_of(const Params& p, int s) {
  fg_seq r;
  r.q_off = p.cu_q[s];
  r.nq = p.cu_q[s + 1] - r.q_off;
  r.k_off = p.cu_k != nullptr ? p.cu_k[s] : 0;  // (null: a paged call given seqused_k only)
  r.nk = p.used_k != nullptr ? p.used_k[s] : p.cu_k[s + 1] - r.k_off;
  return r;
}

// Tile t of a varlen launch: its sequence s, block blk and head h; false (nothing to do) past the list.
template <typename Params>
FG_DEVICE bool fg_varlen_tile(const Params& p, int t, int& s, int& blk, int& h) {
  const int pairs = p.vl_tiles[0];
  const int pair = t / p.heads;
  if (pair >= pairs) {
    s = 0, blk = 0, h = 0;
    return false;
  }
  h = t - pair * p.heads;
  s = p.vl_tiles[2 + 2 * pair];
  blk = p.vl_tiles[3 + 2 * pair];
  return true;
}

// The list's builder: one CTA of 1024 threads. Query-outer kernels (KEYS false: the forward, bwd_dq):
// blocks of BM query rows, each costing the key blocks (of BN) its rows see. Key-outer kernels (KEYS:
// the dK/dV kernels): blocks of BN keys, each costing the query blocks (of BM) that see them. Costs at
// or past NB - 1 share the last bin.
template <int BM, int BN, bool KEYS, typename V, typename Params>
FG_DEVICE void fg_varlen_tiles(const Params& p) {
  constexpr int NB = 2048, NT = 1024, PER = NB / 32, BLOCK = KEYS ? BN : BM;
  __shared__ int bins[NB];
  const int tid = threadIdx.x;
  for (int i = tid; i < NB; i += NT) bins[i] = 0;
  __syncthreads();
  V var(p);
  auto cost = [&](int m) {
    int c;
    if constexpr (KEYS) c = var.query_end(m * BN, BN, BM) - var.query_first(m * BN, BM);
    else c = var.block_end(m * BM, BM, BN) - var.block_first(m * BM, BN);
    return min(NB - 1, max(0, c));
  };
  auto blocks = [&](const fg_seq& q) { return ceil_div(KEYS ? q.nk : q.nq, BLOCK); };
  for (int s = tid; s < p.seqs; s += NT) {
    const fg_seq q = fg_seq_of(p, s);
    var.set_lengths(q.nq, q.nk);
    for (int m = 0; m < blocks(q); ++m) atomicAdd(&bins[cost(m)], 1);
  }
  __syncthreads();
  // bins[c] becomes the number of pairs costing more than c (the first slot of cost c): each lane of
  // warp 0 sums PER bins from the top down, a warp scan, then each lane fills its bins in.
  if (tid < 32) {
    const int top = NB - 1 - PER * tid;
    int sum = 0;
    for (int k = 0; k < PER; ++k) sum += bins[top - k];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, incl, o);
      if (tid >= o) incl += x;
    }
    int run = incl - sum;
    for (int k = 0; k < PER; ++k) {
      const int c = top - k, n = bins[c];
      bins[c] = run;
      run += n;
    }
    if (tid == 31) p.vl_tiles[0] = incl;
  }
  __syncthreads();
  for (int s = tid; s < p.seqs; s += NT) {
    const fg_seq q = fg_seq_of(p, s);
    var.set_lengths(q.nq, q.nk);
    for (int m = 0; m < blocks(q); ++m) {
      const int at = atomicAdd(&bins[cost(m)], 1);
      p.vl_tiles[2 + 2 * at] = s;
      p.vl_tiles[3 + 2 * at] = m;
    }
  }
}
