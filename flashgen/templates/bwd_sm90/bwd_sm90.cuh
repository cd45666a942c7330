// FlashAttention backward for Hopper (sm_90a): TMA + mbarriers + wgmma, K/V outer.
//
// One CTA owns BN = 64 * NWG keys of one (batch, KV head); consumer warpgroup
// cw owns keys [64 cw, 64 cw + 64) of them. A producer warpgroup (one thread)
// loads K and V once by TMA, then streams the query blocks of every query head
// of the KV head's GQA group through an ST-stage ring: per stage Q_i and its
// LSE2 row (one full barrier), dO_i and its D row (another), and an empty
// barrier the consumer warps arrive on when they are done with the stage.
// (LSE2 = LSE * log2 e and D = rowsum(dO * O) - dLSE come from bwd_preprocess,
// in fp32 buffers padded to a multiple of 128 rows: padding rows have LSE2 =
// +inf and D = 0, so they weigh nothing.)
//
// Per query block i (BM = 64 or 128 queries), each consumer warpgroup:
//   S^T  = K_w Q_i^T         wgmma m64nBMk16, A and B K-major from shared memory
//   P^T  = exp2(S^T scale_log2 - LSE2_i)   (LSE2 per column; masked where needed)
//   dP^T = V_w dO_i^T        wgmma SS, as S^T
//   dS^T = P^T (dP^T - D_i)  -> bf16/fp16 to shared memory (sdS, two buffers)
//   dV  += P^T dO_i          wgmma m64nDk16, P^T from registers (the accumulator
//                            layout of S^T is the A-fragment layout, as the
//                            forward's P), dO_i MN-major (the forward's V)
//   dK  += dS^T Q_i          wgmma RS, as dV
//   dQ_i[:, cols of w] = dS K[:, cols of w]   wgmma m64n(D/NWG)k16 over all BN keys, one
//                            per 64 queries of the block (BM / 64 accumulator sets):
//                            A = dS from sdS (stored [key][query] in panels of 64
//                            queries, one 128-byte row a key: MN-major A),
//                            B = K MN-major. Needs every warpgroup's dS: one named
//                            barrier over the consumers per block.
//   the fp32 dQ part is added to the global accumulator (b, h, nq, D):
//     DQW = 0: staged in shared memory (fp32 panels of 32 columns, 128-byte
//              swizzle) and added by the TMA (cp.reduce.async.bulk.tensor .add,
//              rows >= nq clipped by the tensor map);
//     DQW = 1: red.global.add.v2.f32 straight from the accumulators;
//     DQW = 2: as 0, from two staging tiles, the adds issued by the dQ writer
//              (below) instead of a consumer thread (dense rows, no mods);
//     DQW = 3: as 1 with half the reductions: lanes t and t ^ 1 (t = lane % 4) swap
//              a pair, so each holds four consecutive columns of one row
//              (red.global.add.v4.f32);
//     DQW = 4: as 2, from one staging tile of a warpgroup's columns that the
//              warpgroups fill in turn (the writer adds each part), beside a dO ring
//              of one stage (ST_DO): the room a whole staging tile lacks at d = 256.
//     DQW = 5: as 4, the tile freed panel by panel (PANELED): the writer commits each
//              32-column panel's adds as its own bulk group and frees panel p once the
//              TMA has read it (a barrier per warpgroup and panel), so the next
//              warpgroup stages panel p while the TMA still reads the panels after it.
// dK is scaled by the softmax scale at the end (dQ's scale: bwd_convert).
//
// Head dims above 128 (SPLIT): 64 keys a CTA and both consumer warpgroups over all of them; warpgroup
// cw computes S^T / dP^T for queries [32 cw, 32 cw + 32) (m64n32), stores its P^T and dS^T columns
// (sP, sdS), and after the barrier adds dV[:, its D / 2 columns] += P^T dO and dK likewise by SS wgmmas
// (A K-major from sP / sdS, B from the columns' first panel), then dQ as above (D / 2 columns each).
//
// Deterministic (DET, DQW = 0 or 4; its writer as DQW = 2's or 4's, with turns): the CTAs that add to one (batch,
// query head, query block) of dQ take turns in a fixed order, so the fp32 sums, and dQ, are the same
// bits on every run. p.dq_sem holds one counter per (batch, query head, query block), zeroed by the
// host. The consumers stage dQ_i in one of two buffers and arrive on its full barrier; a dQ writer
// (lane 0 of the producer warpgroup's second warp) waits for the buffer, waits (acquire) until the
// counter reads its CTA's position, adds every dQ panel, waits for the adds to land, increments the
// counter (release) and frees the buffer. So the consumers wait for a turn only when they are two
// blocks ahead of it. (DQW = 4: the writer holds the block's turn over the warpgroups' parts of the one
// tile, freeing the tile as each is read; the consumers wait for a turn within a block.) The position
// is the order in which the CTAs reach the block
// anyway: descending key blocks with a right bound (causal, windows: the key block nearest the diagonal
// reaches the block first; blockIdx.x then counts the key blocks from the last, so that a CTA only ever
// waits for CTAs launched before it). Without one (ROT; no variant has a left bound alone) every key
// block sees every query block, and the key blocks
// walk in chunks of p.dq_rot (families/bwd_sm90.det_rotation): CTA j of chunk c starts at query block
// -j mod M and walks the M blocks cyclically, so the chunk's CTAs reach a block at different steps and
// take their turns in that order, after the chunks before (rot_turn). From block 0 they would all reach
// a block at the same step and wait for each other in turn. A CTA may then wait for one of its chunk
// launched after it: the host keeps a chunk within what the GPU holds at once.
//
// Masking: keys >= nk (zero-filled by the TMA) get P = 0; blocks that cross a
// row's visible range (the causal diagonal, a window's sides: V, common/variant.cuh)
// are masked per element (bottom-right alignment); query rows >= nq read zero
// Q/dO (TMA zero fill) and LSE2 = +inf, so P = dS = 0. A CTA walks only the query
// blocks that see its keys (causal: from the first that reaches them; a window's
// left side: up to the last). A softcap's tanh value stays in S^T's registers
// for dS's factor 1 - t^2; ALiBi has no gradient. User mods (common/mod.cuh): the
// score_mod's derivative stays there for dS's factor; with a block mask the CTA
// walks its key block's lists of query blocks and masks only the partial ones.
//
// Shared-memory tiles are the forward's (fwd_sm90.cuh): rows of 64 16-bit
// elements (128 bytes) with the 128-byte swizzle (16-byte chunk c of row r at
// c ^ (r % 8)), tiles of more than 64 columns in panels of rows x 128 bytes;
// where D is an odd multiple of 32 (32, 96), panels of 32 columns (64-byte rows,
// the 64-byte swizzle: chunk c of row r at c ^ ((r / 2) % 4)). dS^T and the
// fp32 dQ staging keep 128-byte rows.
#pragma once

// ---- bulk copies, bulk reductions, the async-proxy fence ----------------------
// 1-D bulk copy global -> shared, completing on an mbarrier (16-byte aligned, size % 16 == 0).
FG_DEVICE void bulk_load(fg_u32 dst, const void* src, fg_u32 bytes, fg_u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Element-wise add of a shared-memory box into a 4-D tensor (the map's type: fp32), bulk-group completion.
FG_DEVICE void tma_reduce_add_4d(const fg_tmap* map, fg_u32 src, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<fg_u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
FG_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// DET's turn-taking on a dQ counter (see the top of this file). The wait is bounded (2^22 reads): a turn
// that never comes (a broken scheduling assumption) ends it rather than hanging the GPU, and the GPU
// tests' comparison of repeated runs would see the order change. (A trap there cost the d = 128 kernel
// 780 bytes of spills and serialized its wgmmas: ptxas C7512.)
FG_DEVICE void dq_turn_wait(const int* sem, int target) {
  int v;
  for (int spins = 0; spins < (1 << 22); ++spins) {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
    if (v >= target) break;
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the TMA adds that follow come after the read
}
FG_DEVICE void dq_turn_done(int* sem) {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the TMA adds (landed) before the release
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(sem) : "memory");
}
// Wait until at most N bulk groups of this thread are still reading their shared-memory source.
template <int N>
FG_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// The same with N known only after unrolling (0 ... 7).
FG_DEVICE void bulk_wait_read_n(int n) {
  switch (n) {
    case 0: bulk_wait_read<0>(); break;
    case 1: bulk_wait_read<1>(); break;
    case 2: bulk_wait_read<2>(); break;
    case 3: bulk_wait_read<3>(); break;
    case 4: bulk_wait_read<4>(); break;
    case 5: bulk_wait_read<5>(); break;
    case 6: bulk_wait_read<6>(); break;
    default: bulk_wait_read<7>(); break;
  }
}
// Wait until at most N bulk groups of this thread are incomplete (writes done).
template <int N>
FG_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory writes (st.shared) become visible to the async proxy (wgmma, TMA).
FG_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
FG_DEVICE float lds_f32(fg_u32 addr) {
  float a;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(a) : "r"(addr));
  return a;
}
FG_DEVICE void lds_f32x2(fg_u32 addr, float& a, float& b) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(a), "=f"(b) : "r"(addr));
}
// Hides a descriptor from the optimizer: the per-k-step descriptors derived from it are computed
// where they are used instead of being hoisted out of the main loop (dozens of 64-bit values).
FG_DEVICE fg_u64 opaque_desc(fg_u64 x) {
  asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
  return x;
}
// Four 8x8 matrices of 16-bit pairs to shared memory in one instruction: register i of every lane is its
// pair (row lane / 4, columns 2 (lane % 4), + 1) of matrix i, and lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes). The m16n8 accumulator layout is that fragment, so a thread's A-fragment
// registers of one k16 step (rows g, g + 8 of two n8 chunks) go out as one x4.
FG_DEVICE void stsm_x4(fg_u32 addr, const fg_u32 (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3]));
}
FG_DEVICE void sts_f32x2(fg_u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b));
}

template <int D, int BM, int BN, int ST, int DQW, bool CAUSAL, bool BF16, int PRODUCER_REGS, int CONSUMER_REGS,
          typename V, bool DPL, bool DQ_EARLY, bool DET, typename Params>
FG_DEVICE void bwd_sm90_body(const Params& p) {
  // SPLIT (D > 128): dK and dV split by columns over two consumer warpgroups of the same 64 keys (each
  // warpgroup's D floats of dK/dV a thread, beside S^T and dP^T, pass the registers above 128): S^T and
  // dP^T split by queries (32 each), P^T and dS^T through shared memory, dV / dK by SS wgmmas.
  constexpr bool SPLIT = D > 128;
  constexpr int NWG = SPLIT ? 2 : BN / 64;  // consumer warpgroups: 64 keys each, or (SPLIT) D / 2 columns
  // Q, K, V, dO rows in panels of RB-byte swizzle rows: 128 bytes (64 columns) where D (SPLIT: D / 2, a
  // warpgroup's columns, which must start on a panel) is a multiple of 64, else 64 bytes (32 columns:
  // D = 32, 96, 192), so that no panel holds columns past the tile.
  constexpr int RB = D % 64 == 0 && (!SPLIT || (D / 2) % 64 == 0) ? 128 : 64;
  constexpr int PC = RB / 2;              // columns per panel
  constexpr int PANELS = D / PC;          // panels per row
  constexpr int KPP = RB / 32;            // k16 steps per K-major panel row
  constexpr fg_u64 SWZ = RB == 128 ? 1 : 2;  // the descriptors' swizzle mode
  constexpr int KV_BYTES = BN * D * 2;    // the K (or V) tile
  constexpr int QT_BYTES = BM * D * 2;    // one stage of Q (or dO)
  constexpr int DS_BYTES = BN * BM * 2;   // one dS^T buffer: MQ panels of BN rows of 64 queries (128 bytes)
  constexpr int MQ = BM / 64;             // 64-query panels of dS^T, m64 dQ GEMMs of a block
  // dQ's D / 32 fp32 panels split over the consumer warpgroups: the first DQP % NWG take DQ_HI columns,
  // the others DQ_LO (D = 96: 64 and 32; D = 32: 32 and none; else D / NWG each). Every warpgroup's dQ
  // GEMM is DQ_HI wide (one wgmma shape: a branch between two made ptxas serialize the wgmmas, C7511 /
  // C7519), over a window of the columns that ends at D where its own are fewer; it adds only its own.
  constexpr int DQP = D / 32;
  constexpr int DQ_LO = DQP / NWG * 32, DQ_HI = (DQP + NWG - 1) / NWG * 32;
  constexpr bool STAGED = DQW == 0 || DQW == 2 || DQW == 4 || DQW == 5;  // dQ through a shared-memory tile and the TMA's adds
  constexpr bool HALVES = DQW == 4 || DQW == 5;  // one staging tile of DQ_HI columns, the warpgroups in turn
  constexpr bool PANELED = DQW == 5;     // ... freed panel by panel
  constexpr int SE_PER = PANELED ? DQ_HI / 32 : 1;  // empty barriers per warpgroup's turn (one per panel)
  constexpr bool WRITER = DET || DQW == 2 || HALVES;  // the dQ writer adds the staged parts
  constexpr int ST_DO = HALVES ? 1 : ST;  // stages of dO (and D): Q's ring, or one beside the halves' tile
  constexpr int STG_ONE = BM * (HALVES ? DQ_HI : D) * 4;  // one fp32 dQ staging tile: panels of BM x 128 bytes
  constexpr int STG_BYTES = STAGED ? (WRITER && !HALVES ? 2 : 1) * STG_ONE : 0;  // (the writer's: two)
  constexpr int NSTG = HALVES ? NWG : 2;  // WRITER: the full / empty barrier pairs (tiles, or warpgroups' turns)
  static_assert(!PANELED || (DQ_LO == DQ_HI && SE_PER <= 8), "dq_write 5: dQ's columns split evenly, 8 panels");
  constexpr int QN = SPLIT ? BM / 2 : BM;  // queries of a warpgroup's S^T / dP^T
  constexpr int DKV = SPLIT ? D / 2 : D;  // columns of a warpgroup's dK / dV
  constexpr int NJ = QN / 8;              // n8 chunks of S^T / dP^T
  constexpr int KP = QN / 16;             // k16 steps of P^T / dS^T in registers
  constexpr int KS = BM / 16;             // k16 steps of dV / dK
  // (128 queries: S^T / dP^T of m64n128, 2 x 64 of P^T / dS^T's registers a thread; SPLIT halves 64)
  static_assert(BM == 64 || (BM == 128 && !SPLIT), "a block of 64 queries, or 128 without SPLIT");
  static_assert(BN % 64 == 0 && D % 32 == 0 && ST >= 2 && (!SPLIT || (BN == 64 && (D / 2) % 32 == 0)),
                "bad bwd_sm90 tile");
  static_assert(DQ_HI <= 256, "dQ columns per warpgroup: one wgmma");
  static_assert(!DET || DQW == 0 || HALVES, "deterministic dQ: the TMA adds");
  static_assert(!WRITER || (!V::VARLEN_ROWS && !V::SPARSE), "the dQ writer walks dense rows");

  extern __shared__ unsigned char smem_raw[];
  // K/V, then per stage: full Q (+LSE2), full dO (+D), empty; WRITER: full and empty per staging tile
  // (HALVES: per warpgroup, its turn on the one tile).
  __shared__ __align__(8) fg_u64 bars[1 + 3 * ST + (WRITER ? NSTG + NSTG * SE_PER : 0)];
  const fg_u32 sK = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const fg_u32 sV = sK + KV_BYTES;
  const fg_u32 sQ = sV + KV_BYTES;
  const fg_u32 sdO = sQ + ST * QT_BYTES;
  const fg_u32 sdS = sdO + ST_DO * QT_BYTES;
  const fg_u32 sP = sdS + 2 * DS_BYTES;  // SPLIT: P^T, two buffers as dS^T's
  const fg_u32 sStg = sP + (SPLIT ? 2 * DS_BYTES : 0);
  // Packed rows: a sequence's LSE2 / D rows need not start 16-byte aligned (no padding between
  // sequences), so each stage's copy starts at the aligned row before and holds 4 floats more (RS).
  constexpr int RS = V::VARLEN_ROWS ? BM + 4 : BM;  // floats per stage of LSE2 (and of D)
  const fg_u32 sL = sStg + STG_BYTES;      // ST x RS floats of LSE2
  const fg_u32 sDd = sL + ST * RS * 4;     // ST_DO x RS floats of D
  const fg_u32 bar_kv = smem_addr(bars);
  auto bar_q = [&](int s) { return bar_kv + 8u * (1 + s); };
  auto bar_do = [&](int s) { return bar_kv + 8u * (1 + ST + s); };
  auto bar_e = [&](int s) { return bar_kv + 8u * (1 + 2 * ST + s); };
  // WRITER: staging tile i written, and its adds have read it. HALVES: bar_sf(w) warpgroup w's part written,
  // bar_se(w) the tile free for warpgroup w (the part before its turn read); PANELED: bar_sep(w, p) its panel p.
  auto bar_sf = [&](int i) { return bar_kv + 8u * (1 + 3 * ST + i); };
  auto bar_se = [&](int i) { return bar_kv + 8u * (1 + 3 * ST + NSTG + i); };
  auto bar_sep = [&](int w, int pn) { return bar_se(w * SE_PER + pn); };

  const int tid = threadIdx.x;
  int b = blockIdx.z, n_block = DET && V::RIGHT ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int hk = blockIdx.y;
  V var(p);
  // Packed rows (V::VARLEN_ROWS, common/varlen.cuh): blockIdx.x is the work list's (sequence b, key
  // block) pair; q_off / k_off the sequence's first query and key row (0 otherwise). The rows after a
  // sequence's last query are the next sequence's (no padding): the consumers give rows past the
  // sequence LSE2 = +inf, so that P = dS = 0 there.
  int q_off = 0, k_off = 0;  // (and the LSE2 / D copies' first row: q_off % 4 before the tile's row 0)
  if constexpr (V::VARLEN_ROWS) {
    int h_unused;
    if (!fg_varlen_tile(p, static_cast<int>(blockIdx.x) * p.heads, b, n_block, h_unused)) return;
    const fg_seq sq = fg_seq_of(p, b);
    var.set_lengths(sq.nq, sq.nk);
    q_off = sq.q_off;
    k_off = sq.k_off;
  }
  const int n0 = n_block * BN;
  const int diag = V::VARLEN_ROWS ? var.diag : p.nk - p.nq;  // bottom-right: query i sees keys j <= i + diag
  const int mb = V::VARLEN_ROWS ? 0 : b;  // the maps' batch coordinate (packed rows: one batch)
  const int m_first = var.query_first(n0, BM), m_end = var.query_end(n0, BN, BM);
  int total = max(0, m_end - m_first) * p.group;  // steps: (query head of the group, query block)
  // DET without a right or left bound: the rotated walk (top of this file). j: the CTA's place in its chunk.
  constexpr bool ROT = DET && !V::RIGHT && !V::LEFT;
  static_assert(!DET || ROT || V::RIGHT, "det: a walk with a left bound alone has no turn order here");
  const int rot_j = ROT ? n_block % p.dq_rot : 0;
  const int m_start = ROT && rot_j ? m_end - rot_j : m_first;  // (p.dq_rot <= m_end - m_first = m_end)
  // The dense walk: query blocks from m_start (cyclically past m_end), the group's query heads in turn.
  auto advance = [&](int& qh, int& qm) {
    if constexpr (ROT) {
      if (++qm == m_end) qm = m_first;
      if (qm == m_start) ++qh;
    } else if (++qm == m_end) {
      qm = m_first;
      ++qh;
    }
  };
  if constexpr (V::SPARSE) total = bwd_sparse_steps(p, b, hk, n_block);  // a block mask: its lists' lengths

  if (tid == 0) {
    tma_prefetch_map(&p.tm_q);
    tma_prefetch_map(&p.tm_k);
    tma_prefetch_map(&p.tm_v);
    tma_prefetch_map(&p.tm_do);
    if constexpr (STAGED) tma_prefetch_map(&p.tm_dq);
    mbar_init(bar_kv, 1);
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_q(s), 1);
      mbar_init(bar_do(s), 1);
      mbar_init(bar_e(s), 128 * NWG);  // every consumer thread
    }
    if constexpr (WRITER) {
      for (int i = 0; i < NSTG; ++i) {
        mbar_init(bar_sf(i), 128 * (HALVES ? 1 : NWG));  // the consumer threads, after their staging stores
        mbar_init(bar_se(i), 1);                         // the dQ writer
      }
      for (int i = NSTG; i < NSTG * SE_PER; ++i) mbar_init(bar_se(i), 1);  // (PANELED: the other panels')
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform for the compiler (the branch below)
  if (wg == 0) {  // ---- producer warpgroup: one thread issues every load
    if constexpr (NWG >= 2) regs_dec<PRODUCER_REGS>();
    if (tid == 0) {
      mbar_expect_tx(bar_kv, 2 * KV_BYTES);
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn) {
        tma_load_4d(sK + pn * BN * RB, &p.tm_k, bar_kv, pn * PC, k_off + n0, hk, mb);
        tma_load_4d(sV + pn * BN * RB, &p.tm_v, bar_kv, pn * PC, k_off + n0, hk, mb);
      }
      constexpr fg_u32 ROW_BYTES = RS * 4;
      // Q_i (+ LSE2) or dO_i (+ D) of query head hq, query block m0 / BM into stage s of its ring. LSE2 / D
      // rows: packed rows start at the 16-byte boundary at or before the tile's first row.
      auto load = [&](bool is_q, int s, int hq, int m0) {
        const fg_i64 row = V::VARLEN_ROWS ? (static_cast<fg_i64>(hq) * p.nq_pad + q_off + m0) & ~3ll
                                          : (static_cast<fg_i64>(b) * p.heads + hq) * p.nq_pad + m0;
        const fg_u32 bar = is_q ? bar_q(s) : bar_do(s), dst = (is_q ? sQ : sdO) + s * QT_BYTES;
        mbar_expect_tx(bar, QT_BYTES + ROW_BYTES);
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
          tma_load_4d(dst + pn * BM * RB, is_q ? &p.tm_q : &p.tm_do, bar, pn * PC, q_off + m0, hq, mb);
        bulk_load((is_q ? sL : sDd) + s * ROW_BYTES, (is_q ? p.lse2 : p.dsum) + row, ROW_BYTES, bar);
      };
      if constexpr (ST_DO == ST) {  // Q_i and dO_i into stage i % ST once step i - ST is done
        int qh = 0, qm = m_start;
        bwd_sparse_walk walk{nullptr, -1, 0, 0};
        for (int it = 0; it < total; ++it) {
          const int s = it % ST;
          if (it >= ST) mbar_wait(bar_e(s), ((it / ST) + 1) & 1);
          if constexpr (V::SPARSE) {
            bool partial_unused;
            qm = walk.next(p, b, hk, n_block, partial_unused);
            qh = walk.qh;
          }
          const int hq = hk * p.group + qh, m0 = qm * BM;
          load(true, s, hq, m0);
          load(false, s, hq, m0);
          if constexpr (!V::SPARSE) advance(qh, qm);
        }
      } else {  // (dense rows, the writer's) dO_i once step i - ST_DO is done, and with it Q_j, j = i + ST - ST_DO
        int qh_q = 0, qm_q = m_start, qh_d = 0, qm_d = m_start, jq = 0;
        auto next_q = [&]() {
          load(true, jq++ % ST, hk * p.group + qh_q, qm_q * BM);
          advance(qh_q, qm_q);
        };
        for (int it = 0; it < total; ++it) {
          if (it >= ST_DO) mbar_wait(bar_e((it - ST_DO) % ST), ((it - ST_DO) / ST) & 1);
          if (jq == it) next_q();  // (the first step's)
          load(false, it % ST_DO, hk * p.group + qh_d, qm_d * BM);
          advance(qh_d, qm_d);
          while (jq < total && jq <= it + ST - ST_DO) next_q();
        }
      }
    } else if (WRITER && tid == 32) {  // the dQ writer: the steps in the consumers' order (dense rows)
      // DET: wait until query block qm's counter reads this CTA's turn (its counter returned), and pass the
      // turn on once the adds have landed.
      // ROT: after the rot * c CTAs of the chunks before, the CTAs of its chunk (rc of them) that reach qm first,
      // those at a smaller step (qm + j') mod M: the walks from m_start cover a cyclic run of the blocks.
      auto rot_turn = [&](int qm) {
        const int rot = p.dq_rot, c = n_block / rot, rc = min(rot, static_cast<int>(gridDim.x) - c * rot);
        const int u = qm - m_first, m = m_end - m_first;
        return c * rot + (u + rot_j < m ? rot_j + max(0, u + rc - m) : rot_j - (m - u));
      };
      auto take_turn = [&](int hq, int qm, int m0) {
        int* sem = p.dq_sem + (static_cast<fg_i64>(b) * p.heads + hq) * (p.nq_pad / BM) + qm;
        dq_turn_wait(sem, ROT ? rot_turn(qm) : var.block_end(m0, BM, BN) - 1 - n_block);
        return sem;
      };
      auto pass_turn = [](int* sem) {
        bulk_wait<0>();
        dq_turn_done(sem);
      };
      int qh = 0, qm = m_start;
      for (int it = 0; it < total; ++it) {
        const int i = it & 1, hq = hk * p.group + qh, m0 = qm * BM;
        if constexpr (HALVES) {  // each warpgroup's part in turn; the tile is then the next warpgroup's
          int* sem = nullptr;  // DET: the block's turn is held over all the parts
#pragma unroll 1
          for (int w = 0; w < NWG; ++w) {
            mbar_wait(bar_sf(w), it & 1);
            if (DET && w == 0) sem = take_turn(hq, qm, m0);
            const int c0 = w * DQ_LO + min(w, DQP % NWG) * 32, n = DQ_LO == DQ_HI || w < DQP % NWG ? DQ_HI : DQ_LO;
            if constexpr (PANELED) {  // a bulk group per panel; panel pn free once at most SE_PER - 1 - pn are unread
#pragma unroll
              for (int pn = 0; pn < SE_PER; ++pn) {
                tma_reduce_add_4d(&p.tm_dq, sStg + pn * BM * 128, c0 + pn * 32, m0, hq, mb);
                bulk_commit();
              }
#pragma unroll
              for (int pn = 0; pn < SE_PER; ++pn) {
                bulk_wait_read_n(SE_PER - 1 - pn);
                mbar_arrive(bar_sep((w + 1) % NWG, pn));
              }
            } else {
#pragma unroll 1
              for (int pn = 0; pn < n / 32; ++pn)
                tma_reduce_add_4d(&p.tm_dq, sStg + pn * BM * 128, c0 + pn * 32, m0, hq, mb);
              bulk_commit();
              bulk_wait_read<0>();
              mbar_arrive(bar_se((w + 1) % NWG));
            }
          }
          if constexpr (DET) pass_turn(sem);  // (every part landed)
        } else {
          mbar_wait(bar_sf(i), (it >> 1) & 1);
          int* sem = nullptr;
          if constexpr (DET) sem = take_turn(hq, qm, m0);
#pragma unroll 1
          for (int pn = 0; pn < D / 32; ++pn)
            tma_reduce_add_4d(&p.tm_dq, sStg + i * STG_ONE + pn * BM * 128, pn * 32, m0, hq, mb);
          bulk_commit();
          if constexpr (DET) {
            pass_turn(sem);
          } else {
            bulk_wait_read<0>();  // read: the tile is free (the adds land on their own)
          }
          mbar_arrive(bar_se(i));
        }
        advance(qh, qm);
      }
      if constexpr (!DET) bulk_wait<0>();  // every add has landed before the CTA exits
    }
    return;
  }
  if constexpr (NWG >= 2) regs_inc<CONSUMER_REGS>();

  // ---- consumer warpgroups ------------------------------------------------------
  const int cw = __shfl_sync(0xffffffffu, wg, 0) - 1;  // warp-uniform for the compiler (fwd_sm90.cuh, cw)
  const int ltid = tid % 128, wq = ltid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int key0 = n0 + (SPLIT ? 0 : cw * 64);  // this warpgroup's first key
  const int qh0 = SPLIT ? cw * QN : 0;           // its first query of a block (S^T, dP^T)
  const int dkv0 = SPLIT ? cw * DKV : 0;         // its first column of dK / dV
  const int krow = wq * 16 + g;                // this thread's key rows: krow and krow + 8 (of the 64)
  // This warpgroup's dQ columns [dq_c0, dq_c0 + dq_n), inside its GEMM's window [dq_w0, dq_w0 + DQ_HI):
  // accumulator chunks (8 columns) dq_skip .. dq_skip + dq_n / 8 are its own.
  const int dq_n = DQ_LO == DQ_HI || cw < DQP % NWG ? DQ_HI : DQ_LO;
  const int dq_c0 = cw * DQ_LO + min(cw, DQP % NWG) * 32, dq_w0 = min(dq_c0, D - DQ_HI);
  const int dq_skip = (dq_c0 - dq_w0) / 8;
  auto dq_own = [&](int nj) { return DQ_LO == DQ_HI || (nj >= dq_skip && nj < dq_skip + dq_n / 8); };

  // Descriptors (fwd_sm90.cuh) in the panels' swizzle (RB): K-major (LBO 16 B, unused; SBO 8 rows) for
  // the S^T / dP^T operands; MN-major (LBO = panel stride, SBO = 8 rows) for dO, Q as B of dV / dK and
  // K as B of dQ; dS as A of dQ: MN-major SW128 (its rows are 64 queries). K for dQ: this warpgroup's
  // columns start in panel dq_c0 / PC, at byte 2 (dq_c0 % PC) of its rows (inside the swizzle row: the
  // swizzle is applied to the address). (Its GEMM reads the window from dq_w0.)
  // SPLIT: S^T / dP^T of every key for queries qh0.. (B's rows start there); dV / dK's B from column
  // dkv0 (a panel's first) and A (P^T, dS^T) K-major from shared memory (128-byte rows of 64 queries).
  const fg_u64 desc_k = smem_desc(sK + (SPLIT ? 0 : cw * 64 * RB), 16, 8 * RB, SWZ);
  const fg_u64 desc_v = smem_desc(sV + (SPLIT ? 0 : cw * 64 * RB), 16, 8 * RB, SWZ);
  const fg_u64 desc_q = smem_desc(sQ + qh0 * RB, 16, 8 * RB, SWZ);
  const fg_u64 desc_do = smem_desc(sdO + qh0 * RB, 16, 8 * RB, SWZ);
  const fg_u64 desc_qmn = smem_desc(sQ + (dkv0 / PC) * BM * RB, BM * RB, 8 * RB, SWZ);
  const fg_u64 desc_domn = smem_desc(sdO + (dkv0 / PC) * BM * RB, BM * RB, 8 * RB, SWZ);
  const fg_u64 desc_ds = sw128_desc(sdS, DS_BYTES, 1024);
  const fg_u64 desc_pk = sw128_desc(sP, 16, 1024), desc_dsk = sw128_desc(sdS, 16, 1024);  // (SPLIT)
  const fg_u64 desc_kmn = smem_desc(sK + (dq_w0 / PC) * BN * RB + (dq_w0 % PC) * 2, BN * RB, 8 * RB, SWZ);
  // Offsets (16-byte units) of k16 step kk: K-major inside a tile of `rows` rows (KPP steps a panel
  // row); MN-major: 16 rows (of RB bytes; dS's: 128).
  auto kmajor_off = [](int kk, int rows) {
    return static_cast<fg_u64>(((kk / KPP) * rows * RB + (kk % KPP) * 32) >> 4);
  };
  auto mn_off = [](int kk) { return static_cast<fg_u64>(kk * 16 * RB >> 4); };
  auto ds_off = [](int kk) { return static_cast<fg_u64>(kk * 16 * 128 >> 4); };

  float acc_dk[DKV / 2], acc_dv[DKV / 2];
#pragma unroll
  for (int i = 0; i < DKV / 2; ++i) {
    acc_dk[i] = 0.f;
    acc_dv[i] = 0.f;
  }

  float acc_s[QN / 2], acc_dp[QN / 2], acc_dq[MQ][DQ_HI / 2];
  mbar_wait(bar_kv, 0);  // always: the CTA must not exit with the K/V copy in flight
  int hc = 0, mc = m_start;
  bwd_sparse_walk walk{nullptr, -1, 0, 0};
  bool partial = false;  // (V::SPARSE: the block mask's flag of this step's block)
  for (int it = 0; it < total; ++it) {
    const int s = it % ST, ph = (it / ST) & 1, s_do = it % ST_DO, ph_do = (it / ST_DO) & 1;
    if constexpr (V::SPARSE) {
      mc = walk.next(p, b, hk, n_block, partial);
      hc = walk.qh;
    }
    const int hq = hk * p.group + hc, m0 = mc * BM;
    if constexpr (!V::SPARSE) advance(hc, mc);
    if constexpr (V::HAS_ALIBI || V::USER) var.set_head(p, b, hq);
    const fg_u64 so = static_cast<fg_u64>((s * QT_BYTES) >> 4);  // stage offset of Q's descriptors
    const fg_u64 so_do = static_cast<fg_u64>((s_do * QT_BYTES) >> 4);  // and of dO's
    const fg_u32 buf = static_cast<fg_u32>(it & 1) * DS_BYTES;

    // ---- S^T = K_w Q_i^T and dP^T = V_w dO_i^T
    mbar_wait(bar_q(s), ph);
    wgmma_fence();
    {
      const fg_u64 da_ = opaque_desc(desc_k), db_ = opaque_desc(desc_q) + so;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) fg_wgmma_sdp(acc_s, da_ + kmajor_off(kk, BN), db_ + kmajor_off(kk, BM), kk);
    }
    wgmma_commit();
    // dP^T's GEMM runs while P^T is computed, its accumulators live there; DP_LATE issues it after P^T
    // instead, for user mods whose functions' registers do not fit beside them (a captured table's
    // reads at d = 128: KernelSpec.dp_late, tried by dispatch when the first build spills).
    constexpr bool DP_LATE = DPL;
    auto issue_dp = [&]() {
      mbar_wait(bar_do(s_do), ph_do);
      wgmma_fence();  // (else ptxas injects one: C7519)
      {
        const fg_u64 da_ = opaque_desc(desc_v), db_ = opaque_desc(desc_do) + so_do;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) fg_wgmma_sdp(acc_dp, da_ + kmajor_off(kk, BN), db_ + kmajor_off(kk, BM), kk);
      }
      wgmma_commit();
    };
    if constexpr (!DP_LATE) issue_dp();

    // ---- P^T (packed 16-bit pairs in the A-fragment order) while dP^T runs
    wgmma_wait<DP_LATE ? 0 : 1>();
    reg_fence(acc_s);
    fg_u32 pa[KP][4], da[KP][4];
    {
      bool need_mask = var.needs_mask(key0, 64, m0 + qh0, m0 + qh0 + QN - 1);
      if constexpr (V::SPARSE) need_mask = partial || key0 + 64 > var.nk;
      if constexpr (V::USER) need_mask = need_mask || m0 + BM > var.nq;  // (a mod's value past the rows: hidden)
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj) {
        float l2[2];
        if constexpr (V::VARLEN_ROWS) {
          const fg_u32 at = sL + (s * RS + (q_off & 3) + qh0 + 8 * nj + 2 * t) * 4;
          const int q = m0 + qh0 + 8 * nj + 2 * t;
          l2[0] = q < var.nq ? lds_f32(at) : INFINITY;
          l2[1] = q + 1 < var.nq ? lds_f32(at + 4) : INFINITY;
        } else {
          lds_f32x2(sL + s * BM * 4 + (qh0 + 8 * nj + 2 * t) * 4, l2[0], l2[1]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float pe[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = acc_s[4 * nj + 2 * h + e];
            if constexpr (V::PLAIN) {
              if (need_mask) {
                const int key = key0 + krow + 8 * h;
                const int q = m0 + qh0 + 8 * nj + 2 * t + e;
                if (key >= (V::VARLEN_ROWS ? var.nk : p.nk) || (CAUSAL && key > q + diag)) x = -INFINITY;
              }
            } else {
              float tv;
              x = var.score(x, m0 + qh0 + 8 * nj + 2 * t + e, key0 + krow + 8 * h, need_mask, tv);
              if constexpr (V::DS_FACTOR) acc_s[4 * nj + 2 * h + e] = tv;  // for dS's factor
            }
            pe[e] = fast_exp2(fmaf(x, p.scale_log2, -l2[e]));
          }
          pa[nj / 2][2 * (nj % 2) + h] = pack2<BF16>(pe[0], pe[1]);
        }
      }
    }
    // ---- dS^T = P^T (dP^T - D), with P rounded to the input dtype (as dV uses it)
    if constexpr (DP_LATE) issue_dp();
    wgmma_wait<0>();
    reg_fence(acc_dp);
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj) {
      float dd[2];
      if constexpr (V::VARLEN_ROWS) {  // (rows past the sequence have P = 0: any D does)
        const fg_u32 at = sDd + (s_do * RS + (q_off & 3) + qh0 + 8 * nj + 2 * t) * 4;
        dd[0] = lds_f32(at);
        dd[1] = lds_f32(at + 4);
      } else {
        lds_f32x2(sDd + s_do * BM * 4 + (qh0 + 8 * nj + 2 * t) * 4, dd[0], dd[1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float pe[2];
        unpack2<BF16>(pa[nj / 2][2 * (nj % 2) + h], pe[0], pe[1]);
        if constexpr (V::DS_FACTOR) {
          pe[0] *= V::dS_factor(acc_s[4 * nj + 2 * h]);
          pe[1] *= V::dS_factor(acc_s[4 * nj + 2 * h + 1]);
        }
        da[nj / 2][2 * (nj % 2) + h] =
            pack2<BF16>(pe[0] * (acc_dp[4 * nj + 2 * h] - dd[0]), pe[1] * (acc_dp[4 * nj + 2 * h + 1] - dd[1]));
      }
    }
    // dS^T rows of this warpgroup into buffer it % 2 (free: every warpgroup passed the previous
    // block's barrier after its dQ GEMM on the buffer before it had completed), by stmatrix: step kk's
    // four registers da[kk] are (rows +0 / +8) x (chunks 2kk / 2kk + 1) of the warp's 16 key rows, and
    // lane l addresses row l % 8 of matrix l / 8: key row 16 wq + 8 ((l / 8) % 2) + l % 8, chunk
    // 2kk + l / 16. Row r's chunk c sits at chunk c ^ (r % 8) (r % 8 == l % 8), so the address is one
    // per-lane base XOR 32 kk (the buffer and the row are 1024- and 128-byte aligned: bits 4-6 are the
    // chunk's). The base is rebuilt per block (opaque), as the dQ staging's are. (Sixteen 4-byte
    // stores a thread before: 4 instructions now.) SPLIT: every key row, this warpgroup's queries
    // from qh0 (chunk 2 (kk + qh0 / 16) + l / 16: XOR 32 (kk + qh0 / 16)), and P^T likewise into sP. 128
    // queries: step kk in panel kk / 4 (BN rows of 128 bytes each), at XOR 32 (kk % 4).
    {
      const fg_u32 base = opaque(sdS + ((SPLIT ? 0 : cw * 64) + wq * 16 + 8 * ((lane >> 3) & 1) + (lane & 7)) * 128 +
                                 ((((lane >> 4) ^ lane) & 7) << 4)) + buf;
#pragma unroll
      for (int kk = 0; kk < KP; ++kk) stsm_x4((base ^ ((kk % 4 + qh0 / 16) << 5)) + (kk / 4) * BN * 128, da[kk]);
      if constexpr (SPLIT) {  // (sP: 1024-byte aligned, 2 DS_BYTES after sdS)
#pragma unroll
        for (int kk = 0; kk < KP; ++kk) stsm_x4((base + 2 * DS_BYTES) ^ ((kk + qh0 / 16) << 5), pa[kk]);
      }
    }
    fence_async_smem();
    if constexpr (DQW == 0 && !WRITER) {
      if (ltid == 0) bulk_wait_read<0>();  // the previous dQ reduce has read the staging tile
    }
    // Every warpgroup's dS^T is in sdS past this barrier. dV and dK read only this warpgroup's registers
    // (not SPLIT), so they are issued before it (DQ_EARLY: dV alone): the tensor pipe starts on them while
    // the warpgroups meet.
    if constexpr (SPLIT) named_sync(1, 128 * NWG);

    // ---- dV += P^T dO_i, dK += dS^T Q_i (RS; SPLIT: SS, A from sP / sdS), then dQ_i part = dS K (SS)
    // DQ_EARLY (KernelSpec.dq_early; not SPLIT): dV, the barrier, dQ, then dK, so that dQ's write below runs
    // while dK's GEMM does, and the Q/dO stage is released after it.
    static_assert(!DQ_EARLY || !SPLIT, "dq_early: the tile without the split");
    auto issue_dq = [&]() {
      const fg_u64 da_ = opaque_desc(desc_ds) + static_cast<fg_u64>(buf >> 4), db_ = opaque_desc(desc_kmn);
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) {  // queries [64 mq, 64 mq + 64): dS^T's panel mq
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          fg_wgmma_dq(acc_dq[mq], da_ + ds_off(kk) + static_cast<fg_u64>(mq * BN * 128 >> 4), db_ + mn_off(kk), kk);
      }
      wgmma_commit();
    };
    wgmma_fence();
    {
      const fg_u64 dv_ = opaque_desc(desc_domn) + so_do, dk_ = opaque_desc(desc_qmn) + so;
      if constexpr (SPLIT) {  // A: 64 key rows of 128 bytes, k16 step kk at byte 32 kk of the row
        const fg_u64 pk_ = opaque_desc(desc_pk) + static_cast<fg_u64>(buf >> 4);
        const fg_u64 sk_ = opaque_desc(desc_dsk) + static_cast<fg_u64>(buf >> 4);
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dv, pk_ + 2 * kk, dv_ + mn_off(kk));
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dk, sk_ + 2 * kk, dk_ + mn_off(kk));
        wgmma_commit();
        issue_dq();
      } else if constexpr (DQ_EARLY) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dv, pa[kk], dv_ + mn_off(kk));
        wgmma_commit();
        named_sync(1, 128 * NWG);
        issue_dq();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dk, da[kk], dk_ + mn_off(kk));
        wgmma_commit();
      } else {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dv, pa[kk], dv_ + mn_off(kk));
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) fg_wgmma_dkv(acc_dk, da[kk], dk_ + mn_off(kk));
        wgmma_commit();
        named_sync(1, 128 * NWG);
        issue_dq();
      }
    }
    wgmma_wait<1>();
    reg_fence(acc_dv);
    if constexpr (DQ_EARLY) {
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) reg_fence(acc_dq[mq]);
    } else {
      reg_fence(acc_dk);
      // Q_i, dO_i, LSE2_i, D_i no longer needed. Every consumer thread arrives for its own reads: with one
      // arrive per warp (ordered after the other lanes' reads by the named barrier above) compute-sanitizer's
      // racecheck reported write-after-read hazards on the LSE2 / D stages; the per-thread arrives measured
      // no slower (docs/perf/backward.md).
      mbar_arrive(bar_e(s));
      wgmma_wait<0>();
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) reg_fence(acc_dq[mq]);
    }

    // ---- dQ_i += the part: thread's rows 64 mq + krow, + 8; columns dq_w0 + 8 nj + 2t (+1), its own nj
    if constexpr (STAGED) {
      // WRITER: tile it % 2, free once the writer's adds of block it - 2 have read it. HALVES: the one tile
      // (its first panel: column dq_c0), free once the writer has read the part before this warpgroup's
      // turn (warpgroup cw - 1's of this block; the last one's of the block before for cw = 0).
      const fg_u32 stg = WRITER && !HALVES ? sStg + static_cast<fg_u32>(it & 1) * STG_ONE : sStg;
      const int turn = cw == 0 ? it - 1 : it;  // HALVES: bar_se(cw)'s completion to wait for (PANELED: each panel's)
      if constexpr (HALVES) {
        if (!PANELED && turn >= 0) mbar_wait(bar_se(cw), turn & 1);
      } else if constexpr (WRITER) {
        if (it >= 2) mbar_wait(bar_se(it & 1), ((it >> 1) - 1) & 1);
      }
      // Column dq_w0 + 8 nj + 2t is in panel dq_w0/32 + nj/4, 16-byte chunk 2 (nj % 4) + t/2,
      // at byte 8 (t % 2); the chunk is swizzled with the row (r % 8 == g): per-row base XOR 32 (nj % 4).
      const int pan0 = dq_w0 / 32 - (HALVES ? dq_c0 / 32 : 0);  // (the window's first panel in the tile)
      auto stage = [&](int nj0, int nj1) {  // accumulator chunks [nj0, nj1)
#pragma unroll
        for (int mq = 0; mq < MQ; ++mq) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const fg_u32 base = opaque(stg + pan0 * BM * 128 + (64 * mq + krow + 8 * h) * 128 +
                                       (((t >> 1) ^ g) << 4) + (t & 1) * 8);
#pragma unroll
            for (int nj = nj0; nj < nj1; ++nj)
              if (dq_own(nj))
                sts_f32x2((base ^ ((nj % 4) << 5)) + (nj / 4) * BM * 128, acc_dq[mq][4 * nj + 2 * h],
                          acc_dq[mq][4 * nj + 2 * h + 1]);
          }
        }
      };
      if constexpr (PANELED) {  // panel pn (chunks 4 pn ... 4 pn + 3) once the writer has read the last part's panel pn
#pragma unroll
        for (int pn = 0; pn < SE_PER; ++pn) {
          if (turn >= 0) mbar_wait(bar_sep(cw, pn), turn & 1);
          stage(4 * pn, 4 * pn + 4);
        }
      } else {
        stage(0, DQ_HI / 8);
      }
      fence_async_smem();
      if constexpr (WRITER) {
        mbar_arrive(bar_sf(HALVES ? cw : it & 1));  // to the dQ writer
      } else {
        named_sync(2 + cw, 128);
        if (ltid == 0) {
#pragma unroll
          for (int pn = 0; pn < DQ_HI / 32; ++pn) {
            const int panel = dq_c0 / 32 + pn;
            if (DQ_LO == DQ_HI || pn < dq_n / 32)
              tma_reduce_add_4d(&p.tm_dq, sStg + panel * BM * 128, panel * 32, q_off + m0, hq, mb);
          }
          bulk_commit();
        }
      }
    } else if constexpr (DQW == 1) {
      float* dq = p.dq_acc + ((static_cast<fg_i64>(mb) * p.heads + hq) * p.nq + q_off + m0) * D + dq_w0 + 2 * t;
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 64 * mq + krow + 8 * h;
          if (m0 + r < var.nq) {
#pragma unroll
            for (int nj = 0; nj < DQ_HI / 8; ++nj)
              if (dq_own(nj))
                red_add_f32x2(dq + r * D + 8 * nj, acc_dq[mq][4 * nj + 2 * h], acc_dq[mq][4 * nj + 2 * h + 1]);
          }
        }
      }
    } else {
      // Even t keeps row krow and takes its partner's pair of that row (columns 2t + 2, 2t + 3); odd t
      // keeps row krow + 8 and takes the partner's pair of it (columns 2t - 2, 2t - 1). Every lane
      // shuffles (the row bound is checked after).
      const bool odd = t & 1;
#pragma unroll
      for (int mq = 0; mq < MQ; ++mq) {
        const float* acc = acc_dq[mq];
        const int r = 64 * mq + krow + (odd ? 8 : 0);
        float* dq = p.dq_acc + ((static_cast<fg_i64>(mb) * p.heads + hq) * p.nq + q_off + m0 + r) * D + dq_w0 +
                    2 * (t & ~1);
        const bool in = m0 + r < var.nq;
#pragma unroll
        for (int nj = 0; nj < DQ_HI / 8; ++nj) {
          if (dq_own(nj)) {  // acc[4 nj], [4 nj + 1]: row krow; [4 nj + 2], [4 nj + 3]: row krow + 8
            const float o0 = __shfl_xor_sync(0xffffffffu, odd ? acc[4 * nj] : acc[4 * nj + 2], 1);
            const float o1 = __shfl_xor_sync(0xffffffffu, odd ? acc[4 * nj + 1] : acc[4 * nj + 3], 1);
            const float k0 = odd ? acc[4 * nj + 2] : acc[4 * nj];
            const float k1 = odd ? acc[4 * nj + 3] : acc[4 * nj + 1];
            if (in) red_add_f32x4(dq + 8 * nj, odd ? o0 : k0, odd ? o1 : k1, odd ? k0 : o0, odd ? k1 : o1);
          }
        }
      }
    }
    if constexpr (DQ_EARLY) {  // dK's GEMM done: Q_i, dO_i, LSE2_i, D_i no longer needed (as above)
      wgmma_wait<0>();
      reg_fence(acc_dk);
      mbar_arrive(bar_e(s));
    }
  }
  if constexpr (DQW == 0 && !WRITER) {
    if (ltid == 0) bulk_wait<0>();  // every dQ reduce has landed before the CTA exits
  }

  // ---- epilogue: dK (times the softmax scale) and dV, rows < nk and columns < d
  elem_t* dk = p.dk + (V::VARLEN_ROWS ? k_off * p.dk_ss : b * p.dk_sb) + hk * p.dk_sh;
  elem_t* dv = p.dv + (V::VARLEN_ROWS ? k_off * p.dv_ss : b * p.dv_sb) + hk * p.dv_sh;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + krow + 8 * h;
    if (key >= var.nk) continue;
    elem_t* rk = dk + static_cast<fg_i64>(key) * p.dk_ss;
    elem_t* rv = dv + static_cast<fg_i64>(key) * p.dv_ss;
#pragma unroll
    for (int nj = 0; nj < DKV / 8; ++nj) {
      const int col = dkv0 + 8 * nj + 2 * t;
      if (col < p.d) {
        *reinterpret_cast<fg_u32*>(rk + col) = pack2<BF16>(acc_dk[4 * nj + 2 * h] * p.scale, acc_dk[4 * nj + 2 * h + 1] * p.scale);
        *reinterpret_cast<fg_u32*>(rv + col) = pack2<BF16>(acc_dv[4 * nj + 2 * h], acc_dv[4 * nj + 2 * h + 1]);
      }
    }
  }
}
