// FlashAttention forward for Hopper (sm_90a): TMA + mbarriers + wgmma.
//
// One CTA owns BM = 64 * NWG query rows of one (batch, head); consumer
// warpgroup cw owns rows [64 cw, 64 cw + 64) (split-Q, no cross-warpgroup
// softmax state). Q arrives once by TMA; K and V blocks of BN rows stream
// through an ST-stage ring, each stage with a full barrier for K, one for V
// (the TMA's transaction count completes them) and an empty barrier the
// consumer warps arrive on when they are done with the stage.
//
// Shared-memory tiles are rows of 64 elements (128 bytes) in the TMA's 128-byte
// swizzle: a tile of R rows x D columns is D/64 "panels" of R x 128 bytes, and
// element (r, c) of a panel sits in 16-byte chunk (c / 8) ^ (r % 8) of row r.
// That is wgmma's canonical SW128 layout both ways round: K-major for Q and K
// (S = Q K^T reads 64-column panels; stepping k by 16 adds 32 bytes), MN-major
// for V (O += P V reads 8-key x 64-column atoms: LBO = panel stride, SBO =
// 1024 bytes between 8-key groups).
//
// S = Q K^T: wgmma m64nBNk16, A and B from shared-memory descriptors. Online
// softmax on the accumulators (scale folded into exp2). O += P V: wgmma
// m64nDk16 with P from registers (the accumulator layout of S is the A
// fragment layout) and V from shared memory (transposed B).
//
// Flags:
//  WS        a producer warpgroup (one thread issues every TMA; setmaxnreg moves
//            its registers to the consumers). Without it, thread 0 of
//            consumer 0 issues the loads in line, after the stage is released.
//  PINGPONG  the consumer warpgroups (two or three) take turns issuing their
//            GEMMs (named barriers 6, 7, 8: each waits on its own, then
//            arrives on the next one's), so one's softmax overlaps the others'
//            GEMMs. One turn per iteration: S(j+1) and P(j)V(j) are issued in
//            the same section (the loop shape of OVERLAP, waiting on both GEMMs
//            before the softmax when OVERLAP is off).
//  OVERLAP   within a warpgroup, S(j+1) = Q K(j+1)^T and O += P(j) V(j) are
//            issued together; the softmax of S(j+1) runs while P(j) V(j) does.
//  EMU       exp2 of EMU/8 of each thread's S columns (n8 chunks spread over
//            the tile) by exp2_fma (FMA pipe) instead of MUFU.EX2, the rest
//            on MUFU: both pipes work on the softmax.
//  SEPKV     (with WS) a K and a V empty barrier per stage: K(j) is released
//            as soon as S(j) has completed, V(j) after P(j)V(j), so the
//            producer refills K while the softmax and P V still run.
//            Without it one empty barrier per stage, released after P(j)V(j).
//  LAZY      lean softmax: the row max by a tree (depth log2 of the columns,
//            not a chain), the row sum in two chains, and the running max
//            moves only when a row's max grows by more than 2^8 in P units
//            (FA4's conditional rescale): else P = 2^(s - m_old) <= 256 and
//            O, l keep their scale, and a warp where no row moved skips O's
//            rescale. O / l and the LSE (m_used + ln l) use the same m, so the
//            result is exact up to rounding (P's relative rounding does not
//            depend on its size).
//  PERSIST   (with WS) a persistent kernel: gridDim.x CTAs (the host sizes it to the SMs)
//            take the p.tiles tiles in the order of tile_coords below (without it, one
//            CTA per tile, blockIdx.x, in that order): tile blockIdx.x
//            first, then each the next one not yet taken, gridDim.x + an atomicAdd on
//            p.sched[0] (dynamic, as the hardware hands out a grid's blocks: a static
//            walk over causal tiles of unequal cost put 6-76 % more work on the
//            slowest CTA in bench/sched_sim.py's model and measured up to 27 % slower). The
//            producer thread takes the tile and hands it to the consumers in
//            tile_slot[] (one per tile number, two in turn), under the Q full barriers (-1: no more). The
//            last CTA to finish zeroes p.sched for the next launch (launches on one
//            stream do not overlap; the host keeps a pair per stream, api). The producer runs on
//            into the next tile: the K/V ring position and its phases count on
//            across tiles. Under PINGPONG the consumers' turns run on across
//            tiles too (one warpgroup's epilogue overlaps the other's GEMMs; the
//            first consumer absorbs the last turn when no tile is left).
//
// Q pieces: each consumer warpgroup's 64 Q rows are a piece of their own (a TMA
// box of 64 rows, its own full barrier), so a warpgroup starts as soon as its
// rows have landed. Without PERSIST there are NWG pieces, one per warpgroup.
// PERSIST: a ring of QP pieces (NWG + 1 or 2 NWG where shared memory allows, else
// NWG); warpgroup w of the CTA's tile number qi takes piece (qi NWG + w) % QP,
// with a 'Q empty' barrier per piece that the warpgroup's warps
// arrive on once its epilogue has read its O rows back out of it (the epilogue
// stages O in its Q rows). One spare piece lets the producer load the first
// warpgroup's next Q while the last one still works on this tile. With QP = NWG
// the producer issues the next tile's first K/V stages before waiting for Q empty.
#pragma once

template <int D, int BM, int BN, int ST, bool WS, bool PINGPONG, bool OVERLAP, bool CAUSAL, bool BF16,
          int PRODUCER_REGS, int CONSUMER_REGS, int EMU, bool SEPKV, bool LAZY, bool PERSIST, int QP,
          typename Params>
FG_DEVICE void fwd_sm90_body(const Params& p) {
  constexpr int NWG = BM / 64;                 // consumer warpgroups
  constexpr int PANELS = D / 64;               // 128-byte panels per row
  constexpr int QW_BYTES = 64 * D * 2;          // one consumer warpgroup's Q rows (a Q piece)
  constexpr int KV_BYTES = BN * D * 2;         // one stage of K (or of V)
  constexpr int NJ = BN / 8;                   // n8 chunks of S
  constexpr int KV_STEPS = BN / 16;            // k16 steps of P V
  static_assert(BM % 64 == 0 && D % 64 == 0 && BN % 16 == 0 && ST >= 2, "bad fwd_sm90 tile");
  static_assert(!PINGPONG || NWG == 2 || NWG == 3, "ping-pong takes two or three consumer warpgroups");
  static_assert(!SEPKV || WS, "separate K/V empty barriers need the producer warpgroup");
  static_assert(EMU == 0 || EMU == 1 || EMU == 2 || EMU == 4, "emu: eighths of the columns (0, 1, 2, 4)");
  static_assert(!PERSIST || WS, "the persistent kernel needs the producer warpgroup");
  static_assert(QP == NWG || (PERSIST && QP > NWG && QP <= 2 * NWG), "Q pieces: NWG, or up to 2 NWG when persistent");
  constexpr int NBAR = SEPKV ? 4 : 3;  // barriers per stage

  extern __shared__ unsigned char smem_raw[];
  // A full barrier per Q piece, then per stage: full K, full V, empty (K's with SEPKV), [empty V];
  // then the never-written target of sched_pin; PERSIST: then an empty barrier per Q piece.
  __shared__ __align__(8) fg_u64 bars[QP + NBAR * ST + 1 + (PERSIST ? QP : 0)];
  // PERSIST: the tile of the CTA's tile number qi in tile_slot[qi % 2], -1 when none is left. Written once
  // the tile's Q pieces are free, i.e. once every consumer is done with tile qi - 1 or qi - 2 (see
  // produce_all): the slot it overwrites (qi - 2's) has been read by all. One slot per tile, not per
  // piece, so that the tile (and every index the main loop derives from it) stays warp-uniform for the
  // compiler: a per-warpgroup slot made the K/V stage, barrier and descriptor values per-thread, with
  // 4 R->UR moves before every wgmma (SASS) and 8-15 % of the persistent kernel's speed lost (H200).
  __shared__ int tile_slot[PERSIST ? 2 : 1];
  const fg_u32 sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;  // 128B-swizzle tiles want 1024-byte alignment
  const fg_u32 sK = sQ + QP * QW_BYTES;
  const fg_u32 sV = sK + ST * KV_BYTES;
  const fg_u32 bar0 = smem_addr(bars);
  auto bar_qf = [&](int i) { return bar0 + 8u * i; };  // Q piece i full
  auto bar_k = [&](int s) { return bar0 + 8u * (QP + s); };
  auto bar_v = [&](int s) { return bar0 + 8u * (QP + ST + s); };
  auto bar_e = [&](int s) { return bar0 + 8u * (QP + 2 * ST + s); };
  auto bar_ev = [&](int s) { return SEPKV ? bar0 + 8u * (QP + 3 * ST + s) : bar_e(s); };  // V's empty barrier
  const fg_u32 pin_slot = bar0 + 8u * (QP + NBAR * ST);
  auto bar_qe = [&](int i) { return bar0 + 8u * (QP + NBAR * ST + 1 + i); };  // Q piece i empty

  const int tid = threadIdx.x;
  // Tile t -> (m_block, head, batch): the (batch, head) pairs in consecutive sections whose K/V fit in
  // the host's share of the L2 (api.tile_sections: sizes p.sec + 1 for the first p.sec_big sections,
  // then p.sec), and inside a section m-block by m-block, every pair of the section in turn (so the CTAs
  // running at once share a few pairs' K/V, but no one K/V block is wanted by every SM at once). Causal:
  // the highest m-blocks (the longest rows) first, so the short tiles fill the tail; non-causal: the
  // lowest first (a partial last m-block, the cheapest tile, at the end).
  auto tile_coords = [&](int t, int& mb, int& h, int& bb) {
    const int mbs = p.m_blocks, big_tiles = p.sec_big * (p.sec + 1) * mbs;
    const bool big = t < big_tiles;
    const int sz = big ? p.sec + 1 : p.sec, u = big ? t : t - big_tiles;
    const int start = (big ? 0 : p.sec_big * (p.sec + 1)) + u / (sz * mbs) * sz, rem = u % (sz * mbs);
    mb = CAUSAL ? mbs - 1 - rem / sz : rem / sz;
    const int pair = start + rem % sz;
    h = pair % p.heads;
    bb = pair / p.heads;
  };
  // K/V blocks that query rows [r0, r0 + rows) need (none when r0 is past the queries).
  auto blocks_for = [&](int r0, int rows) {
    if (r0 >= p.nq) return 0;
    int nb = ceil_div(p.nk, BN);
    if constexpr (CAUSAL) {
      const int limit = min(r0 + rows, p.nq) + (p.nk - p.nq);  // (+ diag, below)
      nb = limit <= 0 ? 0 : min(nb, ceil_div(limit, BN));
    }
    return nb;
  };
  auto blocks_of = [&](int m0_) { return blocks_for(m0_, BM); };
  int tile = static_cast<int>(blockIdx.x);
  int m_block, hq, b;
  tile_coords(tile, m_block, hq, b);
  int hk = hq / p.group;
  int m0 = m_block * BM;
  const int diag = p.nk - p.nq;  // bottom-right alignment: query i sees keys j <= i + diag
  int n_blocks = blocks_of(m0);
  // PERSIST: the same four for each next tile the CTA takes (`tile` set first).
  auto take_tile = [&]() {
    tile_coords(tile, m_block, hq, b);
    hk = hq / p.group;
    m0 = m_block * BM;
    n_blocks = blocks_of(m0);
  };

  if (tid == 0) {
    tma_prefetch_map(&p.tm_q);
    tma_prefetch_map(&p.tm_k);
    tma_prefetch_map(&p.tm_v);
#pragma unroll
    for (int i = 0; i < QP; ++i) {
      mbar_init(bar_qf(i), 1);
      if constexpr (PERSIST) mbar_init(bar_qe(i), 4);  // lane 0 of each of the warpgroup's warps
    }
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_k(s), 1);
      mbar_init(bar_v(s), 1);
      mbar_init(bar_e(s), 4 * NWG);  // lane 0 of every consumer warp
      if constexpr (SEPKV) mbar_init(bar_ev(s), 4 * NWG);
    }
    mbar_init_fence();
  }
  __syncthreads();

  // Load K/V block j of this tile at ring position r (stage r % ST, use r / ST) once the consumers have
  // released that stage. Without PERSIST r = j (one tile per CTA).
  auto produce_at = [&](int r, int j) {
    const int s = r % ST;
    if (r >= ST) mbar_wait(bar_e(s), ((r / ST) + 1) & 1);
    mbar_expect_tx(bar_k(s), KV_BYTES);
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn)
      tma_load_4d(sK + s * KV_BYTES + pn * BN * 128, &p.tm_k, bar_k(s), pn * 64, j * BN, hk, b);
    if constexpr (SEPKV) {
      if (r >= ST) mbar_wait(bar_ev(s), ((r / ST) + 1) & 1);
    }
    mbar_expect_tx(bar_v(s), KV_BYTES);
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn)
      tma_load_4d(sV + s * KV_BYTES + pn * BN * 128, &p.tm_v, bar_v(s), pn * 64, j * BN, hk, b);
  };
  auto produce = [&](int j) { produce_at(j, j); };
  // Warpgroup w's Q rows of the current tile into piece i (a box of 64 rows: rows past nq read zero).
  auto produce_q_piece = [&](int i, int w) {
    mbar_expect_tx(bar_qf(i), QW_BYTES);
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn)
      tma_load_4d(sQ + i * QW_BYTES + pn * 64 * 128, &p.tm_q, bar_qf(i), pn * 64, m0 + 64 * w, hq, b);
  };
  auto produce_q = [&]() {
#pragma unroll
    for (int w = 0; w < NWG; ++w) produce_q_piece(w, w);
  };
  // PERSIST's producer: every tile of this CTA. `it` is the ring position of K/V block j of the tile
  // (counted on across tiles: stage it % ST, use it / ST), `qi` the tile's number in this CTA; use u of
  // Q piece i waits for use u - 1's 'Q empty' phase.
  auto piece_free = [&](int u) {  // u = qi * NWG + w: the u-th piece use of this CTA
    if (u >= QP) mbar_wait(bar_qe(u % QP), ((u / QP) + 1) & 1);
  };
  auto produce_all = [&]() {
    if constexpr (PERSIST) {
    int it = 0;
    for (int qi = 0;; ++qi) {
      if (qi > 0) tile = static_cast<int>(gridDim.x) + atomicAdd(p.sched, 1);
      if (tile >= p.tiles) {  // none left: tell each consumer on its next piece
#pragma unroll 1
        for (int w = 0; w < NWG; ++w) piece_free(qi * NWG + w);
        tile_slot[qi % 2] = -1;
#pragma unroll 1
        for (int w = 0; w < NWG; ++w) mbar_arrive(bar_qf((qi * NWG + w) % QP));  // (release: slot written first)
        break;
      }
      if (qi > 0) take_tile();
      // No spare piece: this tile's first K/V stages go out before waiting for the last epilogue to free Q.
      const int q_after = (QP == NWG && qi > 0) ? min(ST, n_blocks) : 0;
      for (int j = 0; j <= n_blocks; ++j) {
        if (j == q_after) {
#pragma unroll 1
          for (int w = 0; w < NWG; ++w) piece_free(qi * NWG + w);
          tile_slot[qi % 2] = tile;
#pragma unroll 1
          for (int w = 0; w < NWG; ++w) produce_q_piece((qi * NWG + w) % QP, w);
        }
        if (j == n_blocks) break;
        produce_at(it + j, j);
      }
      it += n_blocks;
    }
    // Every CTA has taken its last tile once all have counted themselves done: the last one zeroes
    // the counters for the next launch.
    if (atomicAdd(p.sched + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      p.sched[0] = 0;
      p.sched[1] = 0;
    }
    }
  };

  // The consumer warpgroup index, and below each tile number, pass through __shfl_sync from lane 0: the
  // compiler then knows them warp-uniform, and so every K/V stage, mbarrier address and wgmma descriptor
  // derived from them lives in uniform registers. Read plainly, the Q piece index (cw-dependent) made
  // them per-thread values with 2-4 R2UR moves before every wgmma (SASS: 126 R2URs in the persistent
  // kernel, 33 with the broadcast; 88 -> 9 in the one-tile kernel), and the persistent kernel lost 8-15 %.
  int cw;  // consumer warpgroup index
  if constexpr (WS) {
    const int wg = tid / 128;
    if (wg == 0) {
      if constexpr (NWG >= 2) regs_dec<PRODUCER_REGS>();
      if (tid == 0) {
        if constexpr (PERSIST) {
          produce_all();
        } else {
          produce_q();
          for (int j = 0; j < n_blocks; ++j) produce(j);
        }
      }
      return;
    }
    if constexpr (NWG >= 2) regs_inc<CONSUMER_REGS>();
    cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
  } else {
    cw = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (tid == 0) {
      produce_q();
      for (int j = 0; j < ST && j < n_blocks; ++j) produce(j);
    }
  }

  const int ltid = tid % 128, wq = ltid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // PERSIST: the ring position of this tile's first K/V block, and the tile's position in the Q ring
  // (both stay 0 without it: one tile per CTA).
  int kv0 = 0, qi = 0;
  // PERSIST + PINGPONG: the turns run on across tiles (see pp_end); the first turn is given here once.
  if constexpr (PERSIST && PINGPONG) {
    if (cw == NWG - 1) named_arrive(6, 256);
  }
  while (true) {  // tiles of this CTA (one pass when not persistent)
  const int qp = (qi * NWG + cw) % QP;  // this warpgroup's Q piece for this tile
  if constexpr (PERSIST) {  // the next tile, from the producer (with its Q)
    mbar_wait(bar_qf(qp), ((qi * NWG + cw) / QP) & 1);
    tile = __shfl_sync(0xffffffffu, tile_slot[qi % 2], 0);
    if (tile < 0) {
      // Ping-pong: the last consumer's last turn went to the first one, who takes it here so that
      // every named-barrier phase completes.
      if constexpr (PINGPONG) {
        if (cw == 0) named_sync(6, 256);
      }
      break;
    }
    if (qi > 0) take_tile();
  }
  const fg_u32 sQw = sQ + qp * QW_BYTES;  // this warpgroup's Q rows
  // The CTA's loop runs n_blocks K/V blocks (every stage's barriers go through all of them); this
  // warpgroup computes only the first n_live: none when its 64 rows are all past the queries (the last
  // m-block of a 192-row tile at N = 2k), and under causal masking not the blocks wholly above its own
  // diagonal (they would add exp2(-inf) = 0). A skipped block issues no wgmma and runs no softmax.
  const int n_live = blocks_for(m0 + cw * 64, 64);
  const int row_base = m0 + cw * 64 + wq * 16 + g;  // this thread's rows: row_base and row_base + 8

  // Descriptors: K-major SW128 (LBO 16 B, unused; SBO 1024 B) for Q and K,
  // MN-major SW128 (LBO = panel stride, SBO = 1024 B) for V.
  const fg_u64 desc_q = sw128_desc(sQw, 16, 1024);
  const fg_u64 desc_k = sw128_desc(sK, 16, 1024);
  const fg_u64 desc_v = sw128_desc(sV, BN * 128, 1024);
  // Offsets (in 16-byte units) for k16 step kk inside a tile of `rows` rows.
  auto kmajor_off = [](int kk, int rows) { return static_cast<fg_u64>(((kk / 4) * rows * 128 + (kk % 4) * 32) >> 4); };

  float acc_o[D / 2];
  float acc_s[BN / 2];
  fg_u32 pa[KV_STEPS][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;

  // Ping-pong: each warpgroup's GEMM issues form "sections"; consumer 0 goes
  // first, then they take turns (0, 1[, 2], 0, ...). All run the same number of
  // sections per tile. One tile per CTA: the last arrive of the last consumer is
  // skipped so every barrier phase completes. PERSIST: the turns run on into the
  // next tile (consumer 0 starts it while the others finish this one), and
  // consumer 0 takes the last one when no tile is left.
  auto pp_begin = [&]() {
    if constexpr (PINGPONG) named_sync(6 + cw, 256);
  };
  auto pp_end = [&](bool last) {
    if constexpr (PINGPONG) {
      if (PERSIST || !(last && cw == NWG - 1)) named_arrive(6 + (NWG == 2 ? (cw ^ 1) : (cw + 1) % NWG), 256);
    }
  };
  if constexpr (PINGPONG && !PERSIST) {
    if (cw == NWG - 1 && n_blocks > 0) named_arrive(6, 256);
  }

  auto issue_s = [&](int s) {
    const fg_u64 dk = desc_k + static_cast<fg_u64>((s * KV_BYTES) >> 4);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) fg_wgmma_qk(acc_s, desc_q + kmajor_off(kk, 64), dk + kmajor_off(kk, BN), kk);
  };
  auto issue_pv = [&](int s) {
    const fg_u64 dv = desc_v + static_cast<fg_u64>((s * KV_BYTES) >> 4);
#pragma unroll
    for (int kk = 0; kk < KV_STEPS; ++kk) fg_wgmma_pv(acc_o, pa[kk], dv + static_cast<fg_u64>((kk * 16 * 128) >> 4));
  };
  // Mask (only where block j crosses the key end or this warpgroup's diagonal),
  // then the online-softmax update: acc_s becomes P (fp32), alpha the factor
  // by which O must be rescaled (applied by the caller when O is not in flight).
  auto softmax = [&](int j) {
    const int n0 = j * BN;
    if (n0 + BN > p.nk || (CAUSAL && n0 + BN - 1 > m0 + cw * 64 + diag)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int limit = p.nk;
        if constexpr (CAUSAL) limit = min(limit, row_base + 8 * h + diag + 1);
        limit -= n0 + 2 * t;
#pragma unroll
        for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            if (nj * 8 + e >= limit) acc_s[4 * nj + 2 * h + e] = -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[h];
      if constexpr (LAZY) {  // a tree: depth ~log2(NJ) + 1 instead of a chain of NJ
        float v[NJ];
#pragma unroll
        for (int nj = 0; nj < NJ; ++nj) v[nj] = fmaxf(acc_s[4 * nj + 2 * h], acc_s[4 * nj + 2 * h + 1]);
#pragma unroll
        for (int w = 1; w < NJ; w *= 2)
#pragma unroll
          for (int i = 0; i + w < NJ; i += 2 * w) v[i] = fmaxf(v[i], v[i + w]);
        mx = fmaxf(mx, v[0]);
      } else {
#pragma unroll
        for (int nj = 0; nj < NJ; ++nj) mx = fmaxf(mx, fmaxf(acc_s[4 * nj + 2 * h], acc_s[4 * nj + 2 * h + 1]));
      }
      mx = quad_max(mx);
      // LAZY: keep the old max unless this one is more than 2^8 above it (in P = 2^(scaled s - m)). The
      // scale is positive (api.checked_scale): a first finite max over -inf reads +inf and moves; both -inf
      // reads NaN and stays.
      if constexpr (LAZY) mx = (mx - row_max[h]) * p.scale_log2 > 8.f ? mx : row_max[h];
      const float m_scaled = (mx == -INFINITY ? 0.f : mx) * p.scale_log2;  // all masked so far: no NaN
      if constexpr (LAZY)  // exactly 1 where the max stayed (O, l are 0 while it is -inf: any factor does)
        alpha[h] = mx == row_max[h] ? 1.f : fast_exp2(row_max[h] * p.scale_log2 - m_scaled);
      else
        alpha[h] = fast_exp2(row_max[h] * p.scale_log2 - m_scaled);
      row_max[h] = mx;
      // LAZY: two partial sums (even / odd column of each pair), half the dependent FADD chain.
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = fmaf(acc_s[4 * nj + 2 * h + e], p.scale_log2, -m_scaled);
          // EMU of every 8 n8 chunks (nj = 7; 3, 7; odd) on the FMA pipe; nj is a constant once unrolled.
          const float pe = (nj * EMU) % 8 >= 8 - EMU ? exp2_fma(x) : fast_exp2(x);
          acc_s[4 * nj + 2 * h + e] = pe;
          sum[LAZY ? e : 0] += pe;
        }
      // per-thread partial; quad-summed at the end
      row_sum[h] = row_sum[h] * alpha[h] + (LAZY ? sum[0] + sum[1] : sum[0]);
    }
  };
  auto rescale_o = [&]() {
    // LAZY: alpha is exactly 1 for a row whose max did not move; skip when that holds for the warp.
    if constexpr (LAZY) {
      if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      acc_o[4 * i] *= alpha[0];
      acc_o[4 * i + 1] *= alpha[0];
      acc_o[4 * i + 2] *= alpha[1];
      acc_o[4 * i + 3] *= alpha[1];
    }
  };
  // P as A fragments: k16 step kk takes n8 chunks 2kk and 2kk+1 of S.
  auto pack_p = [&]() {
#pragma unroll
    for (int kk = 0; kk < KV_STEPS; ++kk) {
      pa[kk][0] = pack2<BF16>(acc_s[8 * kk + 0], acc_s[8 * kk + 1]);
      pa[kk][1] = pack2<BF16>(acc_s[8 * kk + 2], acc_s[8 * kk + 3]);
      pa[kk][2] = pack2<BF16>(acc_s[8 * kk + 4], acc_s[8 * kk + 5]);
      pa[kk][3] = pack2<BF16>(acc_s[8 * kk + 6], acc_s[8 * kk + 7]);
    }
  };
  // Debug (p.dbg_s != null, bench/smoke_sm90.py --isolated): the raw S = Q K^T of key block 0 of
  // query block 0 (batch 0, head 0), unscaled and unmasked, as fp32 [BM][BN] rows.
  auto dump_s = [&]() {
    if (p.dbg_s != nullptr && m_block == 0 && hq == 0 && b == 0) {
      const int r = cw * 64 + wq * 16 + g;
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) p.dbg_s[(r + 8 * h) * BN + nj * 8 + 2 * t + e] = acc_s[4 * nj + 2 * h + e];
    }
  };
  // K of block j once S(j) has completed (SEPKV only; else K goes with V in release). release_k and
  // release take the block's ring position (kv0 + j; j itself without PERSIST).
  auto release_k = [&](int j) {
    if constexpr (SEPKV) {
      if (lane == 0) mbar_arrive(bar_e(j % ST));
    }
  };
  // V (and, without SEPKV, K) of block j once P(j) V(j) has completed.
  auto release = [&](int j) {
    if (lane == 0) mbar_arrive(bar_ev(j % ST));
    if constexpr (!WS) {
      if (tid == 0 && j + ST < n_blocks) produce(j + ST);
    }
  };

  // Always (PERSIST: at the top): the epilogue reuses the Q rows, so the Q copy must have landed.
  if constexpr (!PERSIST) mbar_wait(bar_qf(qp), 0);

  // Two loop shapes. Without overlap or ping-pong: S(j), softmax, P(j)V(j), each GEMM waited on.
  // With either: one GEMM section per iteration, S(j) and P(j-1)V(j-1) issued together (one named-
  // barrier turn per iteration under ping-pong, so the other warpgroup's section runs during this
  // one's softmax). OVERLAP then runs softmax(j) between the two waits (P(j-1)V(j-1) in flight);
  // without it both GEMMs are waited on first.
  if constexpr (!OVERLAP && !PINGPONG) {
    for (int j = 0; j < n_live; ++j) {
      const int s = (kv0 + j) % ST, ph = ((kv0 + j) / ST) & 1;
      mbar_wait(bar_k(s), ph);
      pp_begin();
      wgmma_fence();
      issue_s(s);
      wgmma_commit();
      pp_end(false);
      wgmma_wait<0>();
      reg_fence(acc_s);
      release_k(kv0 + j);
      if (j == 0) dump_s();
      softmax(j);
      rescale_o();
      pack_p();
      mbar_wait(bar_v(s), ph);
      pp_begin();
      reg_fence(acc_o);
      wgmma_fence();
      issue_pv(s);
      wgmma_commit();
      pp_end(j == n_blocks - 1);
      wgmma_wait<0>();
      reg_fence(acc_o);
      release(kv0 + j);
    }
  } else if (n_live > 0) {
    mbar_wait(bar_k(kv0 % ST), (kv0 / ST) & 1);
    pp_begin();
    wgmma_fence();
    issue_s(kv0 % ST);
    wgmma_commit();
    pp_end(false);
    wgmma_wait<0>();
    reg_fence(acc_s);
    release_k(kv0);
    dump_s();
    softmax(0);  // O is still zero: no rescale needed
    for (int j = 1; j < n_live; ++j) {
      const int r = kv0 + j, s = r % ST, sp = (r - 1) % ST;
      pack_p();  // P(j-1)
      mbar_wait(bar_k(s), (r / ST) & 1);
      mbar_wait(bar_v(sp), ((r - 1) / ST) & 1);
      pp_begin();
      reg_fence(acc_o);
      wgmma_fence();
      issue_s(s);
      wgmma_commit();
      issue_pv(sp);
      wgmma_commit();
      pp_end(false);
      if constexpr (OVERLAP) {
        wgmma_wait<1>();  // S(j) done; P(j-1) V(j-1) may still run
        reg_fence(acc_s);
        release_k(r);
        softmax(j);
        // ptxas schedules WARPGROUP.DEPBAR as early as it may: without this pin the wait below
        // lands before the softmax's exp2s (SASS), and P(j-1)V(j-1) never overlaps them.
        sched_pin(row_sum[0] + row_sum[1], pin_slot);
        wgmma_wait<0>();
        reg_fence(acc_o);
        release(r - 1);
      } else {
        wgmma_wait<0>();
        reg_fence(acc_o);
        release_k(r);
        release(r - 1);  // stage j-1 is free before the softmax, not after it
        reg_fence(acc_s);
        softmax(j);
      }
      rescale_o();
    }
    const int jl = kv0 + n_live - 1, sl = jl % ST;
    pack_p();
    mbar_wait(bar_v(sl), (jl / ST) & 1);
    pp_begin();
    reg_fence(acc_o);
    wgmma_fence();
    issue_pv(sl);
    wgmma_commit();
    pp_end(n_live == n_blocks);
    wgmma_wait<0>();
    reg_fence(acc_o);
    release(jl);
  }

  // The blocks past n_live: waited on and released like the others, and under ping-pong one turn each
  // (every consumer takes n_blocks + 1 turns per tile: with none live, one more for the S(0) turn).
  if (n_live < n_blocks) {
    if (n_live == 0) {
      pp_begin();
      pp_end(false);
    }
    for (int j = n_live; j < n_blocks; ++j) {
      const int r = kv0 + j, s = r % ST, ph = (r / ST) & 1;
      mbar_wait(bar_k(s), ph);
      mbar_wait(bar_v(s), ph);
      pp_begin();
      pp_end(j == n_blocks - 1);
      release_k(r);
      release(r);
    }
  }

  // ---- epilogue: normalise, stage O in this warpgroup's own Q rows, store ---
  // PERSIST: the thread index through an opaque move, so that the compiler cannot compute the O store
  // loop's row / chunk / swizzle indices (tile-invariant) once before the tile loop and keep them live
  // through every main loop (it did: 56 B of spills at d=128 192x80, 160 registers per consumer thread).
  int ltid_e = ltid;
  if constexpr (PERSIST) asm volatile("mov.b32 %0, %0;\n" : "+r"(ltid_e));
  named_sync(2 + cw, 128);  // every warp of this warpgroup is done reading its Q rows
  const fg_i64 lse_base = (static_cast<fg_i64>(b) * p.heads + hq) * p.nq;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(row_sum[h]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int r = wq * 16 + g + 8 * h;  // row within this warpgroup's piece
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const fg_u32 packed = pack2<BF16>(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
      const fg_u32 addr = sQw + (i / 8) * 64 * 128 + r * 128 + (((i % 8) ^ (r % 8)) * 16) + 4 * t;
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
    }
    const int row = row_base + 8 * h;
    if (p.lse != nullptr && t == 0 && row < p.nq)
      p.lse[lse_base + row] = l > 0.f ? row_max[h] * p.scale + logf(l) : -INFINITY;
  }
  named_sync(2 + cw, 128);
  elem_t* o = p.o + b * p.o_sb + hq * p.o_sh;
  constexpr int CH = 64 * (D / 8);  // 16-byte chunks of this warpgroup's 64 rows
#pragma unroll
  for (int it = 0; it < CH / 128; ++it) {
    const int i = it * 128 + ltid_e;
    const int rl = i / (D / 8), c = i % (D / 8);
    const int row = m0 + cw * 64 + rl;
    if (row < p.nq && c * 8 < p.d) {
      fg_u32x4 val;
      asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(sQw + (c / 8) * 64 * 128 + rl * 128 + (((c % 8) ^ (rl % 8)) * 16))
                   : "memory");
      *reinterpret_cast<fg_u32x4*>(o + static_cast<fg_i64>(row) * p.o_ss + c * 8) = val;
    }
  }
  if constexpr (PERSIST) {
    // This warp has read its O rows back out of the Q buffer: the producer may refill it (the proxy
    // fence orders this thread's generic st.shared before the TMA's async-proxy write of the next Q).
    fence_proxy_async_smem();
    __syncwarp();
    if (lane == 0) mbar_arrive(bar_qe(qp));
    kv0 += n_blocks;
    ++qi;
  } else {
    break;
  }
  }  // tiles
}
