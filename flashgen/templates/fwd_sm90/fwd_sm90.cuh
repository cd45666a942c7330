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
//  WS        a producer warpgroup (one thread issues every TMA, or with paged
//            K/V of one tile per CTA one lane per page box; setmaxnreg moves
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
//  FMA_EXP2  exp2 of FMA_EXP2/8 of each thread's S columns (n8 chunks spread over
//            the tile) by exp2_fma (FMA pipe) instead of MUFU.EX2, the rest
//            on MUFU: both pipes work on the softmax.
//  EARLY_K   (with WS) a K and a V empty barrier per stage: K(j) is released
//            as soon as S(j) has completed, V(j) after P(j)V(j), so the
//            producer refills K while the softmax and P V still run.
//            Without it one empty barrier per stage, released after P(j)V(j).
//  LEAN      lean softmax: the row max by a tree (depth log2 of the columns,
//            not a chain), the row sum in two chains, and the running max
//            moves only when a row's max grows by more than 2^8 in P units
//            (FA4's conditional rescale): else P = 2^(s - m_old) <= 256 and
//            O, l keep their scale, and a warp where no row moved skips O's
//            rescale. O / l and the LSE (m_used + ln l) use the same m, so the
//            result is exact up to rounding (P's relative rounding does not
//            depend on its size).
//  PERSISTENT (with WS) a persistent kernel: gridDim.x CTAs (the host sizes it to the SMs)
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
//  FP8       (with WS, one tile per CTA) Q, K, V in float8 e4m3, one byte an element (rows of
//            64-element panels become 128-element ones; d = 64 is one 64-byte panel in the 64-byte
//            swizzle); wgmma k32. FP8 operands must be K-major, so V's block is transposed: the TMA
//            brings it into one of two raw buffers, warps 1-3 of the producer warpgroup write V^T
//            (d rows of keys, in panels of 128 keys; a 64-key one in the 64-byte swizzle ends a
//            192-key block) into the V stage (transpose_v), with the keys of every 16 in the order
//            the consumers' P registers hold them. P is rounded to e4m3 (its row sums stay fp32); the
//            descale factors join the scales per tile (fp8_scales); O goes from the registers to
//            global memory (epilogue_direct).
//  BIAS_GEMM (V::ALIBI_LINEAR, not FP8) the linear bias's column part, slope times the key's column in
//            its block, comes out of S's GEMM: one more wgmma k16 step per block (issue_s) with A from
//            registers, the slope split into three bf16 parts hi + mid + lo in columns 0-2 of every row
//            (bias_frag, per tile), and B a constant tile with B[k][j] = j for k = 0-3 (fill_bias_tile,
//            once per CTA), so S = Q K^T + (hi + mid + lo) j in fp32 (the parts carry the slope's 24 bits:
//            products of 8-bit parts and integers below 256 are exact). The softmax then adds nothing per
//            score; the row part, the slope times (n0 - row - diag), goes into the row max and the
//            exp2's offset as before (alibi_row_offset with the block's first key instead of the
//            thread's first column).
//
// Q pieces: each consumer warpgroup's 64 Q rows are a piece of their own (a TMA
// box of 64 rows, its own full barrier), so a warpgroup starts as soon as its
// rows have landed. Without PERSISTENT there are NWG pieces, one per warpgroup.
// PERSISTENT: a ring of QP pieces (NWG + 1 or 2 NWG where shared memory allows, else
// NWG); warpgroup w of the CTA's tile number qi takes piece (qi NWG + w) % QP,
// with a 'Q empty' barrier per piece that the warpgroup's warps
// arrive on once its epilogue has read its O rows back out of it (the epilogue
// stages O in its Q rows). One spare piece lets the producer load the first
// warpgroup's next Q while the last one still works on this tile. With QP = NWG
// the producer issues the next tile's first K/V stages before waiting for Q empty.
//
// Code: fwd_sm90_cta holds one CTA's state, with its stages as member functions: the setup (shared
// memory, the first tile), the producer (the TMA loads: produce_*), the consumer's main loop over one
// tile's K/V blocks (consume_tile, calling issue_s / issue_pv, softmax, rescale_o, pack_p and the stage
// releases) and its epilogue. fwd_sm90_body runs them: barrier setup, the warp roles, the tile loop.
// Everything is inlined (FG_DEVICE), and where the state lives is chosen so that the compiler emits the
// machine code it did when this was one function: the register arrays (O, S, P, the row state) are
// locals of consume_tile, the function that holds the K/V loops, and reach the stages by reference
// (an array member would keep the whole struct in memory until the loops are unrolled); consume_tile
// works on a local copy of the struct, so that every field it reads in its loops is a register value.
#pragma once

template <int D, int BM, int BN, int ST, bool WS, bool PINGPONG, bool OVERLAP, bool CAUSAL, bool BF16,
          int FMA_EXP2, bool EARLY_K, bool LEAN, bool PERSISTENT, int QP, int PAGE_ROWS, bool GATHER, bool FP8,
          bool BIAS_GEMM, typename V, typename Params>
struct fwd_sm90_cta {
  // (Enumerators, not static constexpr members: NVRTC emits such a member as a global object.)
  enum : int {
    NWG = BM / 64,                 // consumer warpgroups
    EB = FP8 ? 1 : 2,              // bytes per element of Q, K and V
    ROWB = D * EB < 128 ? D * EB : 128,  // bytes per swizzled row of a Q/K/V panel (64: FP8 at d = 64)
    ROW_ELEMS = ROWB / EB,         // elements per panel row (the TMA box's width)
    PANELS = D * EB / ROWB,        // panels per row
    QW_BYTES = 64 * D * EB,        // one consumer warpgroup's Q rows (a Q piece)
    KV_BYTES = BN * D * EB,        // one stage of K (or of V)
    NJ = BN / 8,                   // n8 chunks of S
    KSTEP = 32 / EB,               // k of one wgmma (32 bytes of each operand row)
    KV_STEPS = BN / KSTEP,         // k steps of P V
    // FP8: V^T's rows (keys) in swizzled panels of 128-byte rows (one of BN bytes at BN = 64), the last
    // of VT_LAST-byte rows (64 at BN = 192: its own 64-byte swizzle, so a stage stays BN * D bytes); VR
    // raw V buffers that the TMA fills and the producer warpgroup's transposing warps read.
    VT_ROWB = FP8 ? (BN < 128 ? BN : 128) : 128,
    VT_LAST = FP8 && BN > 128 && BN % 128 ? BN % 128 : VT_ROWB,
    VR = FP8 ? 2 : 0,
    TREE_MAX = LEAN || D <= 64,    // the row max as a tree (softmax below)
    TRANSPOSERS = 96,              // FP8: the producer warpgroup's warps 1-3 (warp 0 issues the TMA)
    BIAS_BYTES = 8 * BN + 128,     // BIAS_GEMM: the B tile (fill_bias_tile; the host sizes it the same)
    NBAR = EARLY_K ? 4 : 3,        // barriers per stage
    // Paged K/V (PAGE_ROWS > 0): a K/V block is CHUNKS boxes of PAGE_ROWS rows, each from its own page.
    CHUNKS = PAGE_ROWS ? BN / PAGE_ROWS : 1,
    // GATHER: the producer warpgroup's 128 threads copy the rows by cp.async, 16 bytes each: CPR chunks
    // a row, GATHER_PER per thread and block.
    CPR = D / 8,
    GATHER_PER = BN * CPR / 128,
  };
  static_assert(PAGE_ROWS == 0 || (V::VARLEN_ROWS && PAGE_ROWS % 8 == 0 && BN % PAGE_ROWS == 0),
                "paged K/V: boxes of a multiple of 8 rows dividing BN (whole 1024-byte swizzle atoms), packed rows");
  static_assert(!GATHER || (PAGE_ROWS > 0 && WS && !PERSISTENT && (BN * CPR) % 128 == 0),
                "gathered K/V rows: paged, by the producer warpgroup of a one-tile-per-CTA kernel");
  static_assert(!BIAS_GEMM || (!FP8 && V::ALIBI_LINEAR && !V::HAS_CAP),
                "bias_gemm: a linear bias (causal ALiBi without a softcap, a linear score_mod) in a bf16/fp16 kernel");
  static_assert(!FP8 || (WS && !PERSISTENT && PAGE_ROWS == 0 && !V::VARLEN_ROWS && !V::SPARSE && !V::USER &&
                         (BN == 64 || BN == 128 || BN == 192)),
                "FP8: a one-tile-per-CTA kernel with the producer warpgroup (its warps transpose V), contiguous K/V, "
                "no mods, block_n 64, 128 or 192 (V^T panels of whole 64- or 128-byte swizzle rows)");

  const Params& p;
  int (&tile_slot)[PERSISTENT ? 2 : 1];  // PERSISTENT: the tile of tile number qi in tile_slot[qi % 2]
  fg_u32 sQ, sK, sV, sVr, bar0, pin_slot, page_slot;
  int tid;
  // The current tile and its coordinates (PERSISTENT moves them on: take_tile). With packed rows
  // (V::VARLEN_ROWS, common/varlen.cuh) b is the sequence, q_off / k_off its first query and key row in
  // the packed tensors (0 otherwise), and n_tiles the list's count times the heads (p.tiles otherwise).
  int tile, m_block, hq, b, hk, m0, n_blocks, q_off, k_off, n_tiles;
  // Paged K/V: the current sequence's key count.
  int seq_nk;
  // The variant (common/variant.cuh: the keys each row sees, the score transforms, the sink) of the
  // current (batch, head), and the first key block the tile visits (0 without a window's left side): the
  // tile's K/V blocks are n_first, n_first + 1, ..., n_first + n_blocks - 1.
  V var;
  int n_first;
  // FP8: the current tile's descale factors folded into the softmax's scales (f8_sl2 the exp2's factor,
  // f8_scale the LSE's) and V's factor for the output (fp8_scales).
  float f8_sl2, f8_scale, f8_v;
  // Consumer threads (set by the body once the warp roles are known): the warpgroup, this thread's index
  // in it, its warp, lane, quad row and column.
  int cw, ltid, wq, lane, g, t;
  // The current tile's (consume_tile): this warpgroup's Q piece and its rows, the blocks it computes,
  // this thread's first row, the descriptors.
  int qp;
  fg_u32 sQw;
  int n_live, row_base;
  fg_u64 desc_q, desc_k, desc_v, desc_vl;  // (desc_vl: FP8's last V^T panel, when its rows are narrower)

  // ---- setup: shared-memory carve-up, the first tile ----
  FG_DEVICE fwd_sm90_cta(const Params& p, fg_u32 smem_base, fg_u32 bars, int (&tile_slot)[PERSISTENT ? 2 : 1])
      : p(p), tile_slot(tile_slot) {
    sQ = (smem_base + 1023u) & ~1023u;  // 128B-swizzle tiles want 1024-byte alignment
    sK = sQ + QP * QW_BYTES;
    sV = sK + ST * KV_BYTES;   // (FP8: V^T, written by the producer warpgroup)
    sVr = sV + ST * KV_BYTES;  // (FP8: VR raw V blocks as the TMA brings them; BIAS_GEMM: the B tile)
    bar0 = bars;
    pin_slot = bar0 + 8u * (QP + NBAR * ST);
    page_slot = bar0 + 8u * (QP + NBAR * ST + 1 + (PERSISTENT ? QP : 0));  // paged: CHUNKS ints after the barriers
    tid = threadIdx.x;
    tile = static_cast<int>(blockIdx.x);
    n_tiles = V::VARLEN_ROWS ? p.vl_tiles[0] * p.heads : p.tiles;
    q_off = k_off = 0;
    var = V(p);
    tile_coords(tile, m_block, hq, b);
    set_tile();
  }

  // A full barrier per Q piece, then per stage: full K, full V, empty (K's with EARLY_K), [empty V];
  // then the never-written target of sched_pin; PERSISTENT: then an empty barrier per Q piece.
  FG_DEVICE fg_u32 bar_qf(int i) const { return bar0 + 8u * i; }  // Q piece i full
  FG_DEVICE fg_u32 bar_k(int s) const { return bar0 + 8u * (QP + s); }
  FG_DEVICE fg_u32 bar_v(int s) const { return bar0 + 8u * (QP + ST + s); }
  FG_DEVICE fg_u32 bar_e(int s) const { return bar0 + 8u * (QP + 2 * ST + s); }
  // V's empty barrier (K's and V's are one without EARLY_K)
  FG_DEVICE fg_u32 bar_ev(int s) const { return EARLY_K ? bar0 + 8u * (QP + 3 * ST + s) : bar_e(s); }
  // A consumer's wait on a full K or V barrier. GATHER: the rows were written by cp.async (the generic
  // proxy), and wgmma reads its operands through the async proxy: the fence orders the two.
  FG_DEVICE void kv_wait(fg_u32 bar, int parity) const {
    mbar_wait(bar, parity);
    if constexpr (GATHER) fence_proxy_async_smem();
  }
  FG_DEVICE fg_u32 bar_qe(int i) const { return bar0 + 8u * (QP + NBAR * ST + 1 + i); }  // Q piece i empty
  // FP8: raw V buffer i full (the TMA) and empty (the transposing warps), after the sched_pin target.
  FG_DEVICE fg_u32 bar_vr(int i) const { return bar0 + 8u * (QP + NBAR * ST + 1 + i); }
  FG_DEVICE fg_u32 bar_vre(int i) const { return bar0 + 8u * (QP + NBAR * ST + 1 + VR + i); }

  // Tile t -> (m_block, head, batch): the (batch, head) pairs in consecutive sections whose K/V fit in
  // the host's share of the L2 (api.tile_sections: sizes p.sec + 1 for the first p.sec_big sections,
  // then p.sec), and inside a section m-block by m-block, every pair of the section in turn (so the CTAs
  // running at once share a few pairs' K/V, but no one K/V block is wanted by every SM at once). Causal:
  // the highest m-blocks (the longest rows) first, so the short tiles fill the tail (a block mask's too:
  // causal-like masks are the common ones); non-causal: the lowest first (a partial last m-block, the
  // cheapest tile, at the end).
  FG_DEVICE void tile_coords(int t, int& mb, int& h, int& bb) const {
    if constexpr (V::VARLEN_ROWS) {  // the device-built list (past its end: sequence 0, never computed)
      fg_varlen_tile(p, t, bb, mb, h);
      return;
    }
    const int mbs = p.m_blocks, big_tiles = p.sec_big * (p.sec + 1) * mbs;
    const bool big = t < big_tiles;
    const int sz = big ? p.sec + 1 : p.sec, u = big ? t : t - big_tiles;
    const int start = (big ? 0 : p.sec_big * (p.sec + 1)) + u / (sz * mbs) * sz, rem = u % (sz * mbs);
    mb = (CAUSAL || V::SPARSE) ? mbs - 1 - rem / sz : rem / sz;
    const int pair = start + rem % sz;
    h = pair % p.heads;
    bb = pair / p.heads;
  }
  // K/V blocks from n_first on that query rows [r0, r0 + rows) need (none when r0 is past the queries).
  FG_DEVICE int blocks_for(int r0, int rows) const {
    if constexpr (V::SPARSE) return r0 < var.nq ? var.count : 0;  // (set_block_row first)
    if constexpr (V::LEFT) return max(0, var.block_end(r0, rows, BN) - n_first);
    return var.block_end(r0, rows, BN);
  }
  // The key block of the tile's j-th K/V block.
  FG_DEVICE int kv_block(int j) const {
    if constexpr (V::SPARSE) return var.block_at(j);  // a block mask's list (common/mod.cuh)
    return V::LEFT ? n_first + j : j;
  }
  // The tile's coordinates' consequences: its K/V head, first row, variant values and key blocks.
  FG_DEVICE void set_tile() {
    if constexpr (V::VARLEN_ROWS) {
      const fg_seq sq = fg_seq_of(p, b);
      q_off = sq.q_off;
      k_off = sq.k_off;
      var.set_lengths(sq.nq, sq.nk);
      if constexpr (PAGE_ROWS > 0) seq_nk = sq.nk;
    }
    hk = hq / p.group;
    m0 = m_block * BM;
    var.set_head(p, b, hq);
    if constexpr (V::SPARSE) var.set_block_row(p, m_block);
    if constexpr (FP8) fp8_scales();
    n_first = var.block_first(m0, BN);
    n_blocks = blocks_for(m0, BM);
  }
  // FP8: S is (q_descale k_descale) times the score of the dequantized inputs. The product joins the unit
  // the scores are held in (variant.cuh): the softmax's scales, or with a softcap the factor before the
  // tanh (the softmax's scale is then the cap); ALiBi's slope, divided by that unit, follows it. O is
  // v_descale times P V.
  FG_DEVICE void fp8_scales() {
    const float qk = p.qd[b * p.qd_sb + (hq / p.qd_div) * p.qd_sh] * p.kd[b * p.kd_sb + hk * p.kd_sh];
    f8_v = p.vd[b * p.vd_sb + hk * p.vd_sh];
    f8_sl2 = p.scale_log2;
    f8_scale = p.scale;
    if constexpr (V::HAS_CAP) {
      var.cap_in = p.cap_in * qk;
    } else {
      f8_sl2 *= qk;
      f8_scale *= qk;
      if constexpr (V::HAS_ALIBI) var.slope /= qk;
    }
  }
  // The softmax's exp2 factor and the LSE's scale (FP8: with the tile's descales).
  FG_DEVICE float sl2() const {
    if constexpr (FP8) return f8_sl2;
    else return p.scale_log2;
  }
  FG_DEVICE float lse_scale() const {
    if constexpr (FP8) return f8_scale;
    else return p.scale;
  }
  // PERSISTENT: the same for each next tile the CTA takes (`tile` set first).
  FG_DEVICE void take_tile() {
    tile_coords(tile, m_block, hq, b);
    set_tile();
  }

  FG_DEVICE void init_barriers() {
    tma_prefetch_map(&p.tm_q);
    tma_prefetch_map(&p.tm_k);
    tma_prefetch_map(&p.tm_v);
#pragma unroll
    for (int i = 0; i < QP; ++i) {
      mbar_init(bar_qf(i), 1);
      if constexpr (PERSISTENT) mbar_init(bar_qe(i), 4);  // lane 0 of each of the warpgroup's warps
    }
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar_init(bar_k(s), GATHER ? 128 : 1);  // GATHER: one asynchronous arrive per producer thread
      // FP8: V^T's stage is full once every transposing thread has arrived
      mbar_init(bar_v(s), GATHER ? 128 : FP8 ? TRANSPOSERS : 1);
      mbar_init(bar_e(s), 4 * NWG);  // lane 0 of every consumer warp
      if constexpr (EARLY_K) mbar_init(bar_ev(s), 4 * NWG);
    }
#pragma unroll
    for (int i = 0; i < VR; ++i) {
      mbar_init(bar_vr(i), 1);
      mbar_init(bar_vre(i), TRANSPOSERS);
    }
    mbar_init_fence();
  }

  // BIAS_GEMM's B tile (MN-major, no swizzle: a core matrix is 8 k rows of 16 bytes, each 8 consecutive
  // columns n; LBO = SBO = 64 bytes between core matrices along n and along k, so the two offsets cannot be
  // taken for each other): BIAS_BYTES after the V ring, 16-byte chunk c holding the 8 bf16 values
  // 8 (c / 4) ... 8 (c / 4) + 7. B[k][n] then sits in chunk 4 (n / 8) + k % 8 + 4 (k / 8) at element n % 8:
  // n for k = 0-3, which hold the rows that meet A's nonzero columns (bias_frag: 0-2); rows k 4-15 read
  // other chunks, finite values times A's zeros (the last keys' read the 128 bytes past 8 BN). Written by
  // every thread before the kernel's first barrier (the proxy fence: wgmma reads it through the async proxy).
  FG_DEVICE fg_u32 bias_tile() const { return sV + ST * KV_BYTES; }
  FG_DEVICE void fill_bias_tile() const {
    for (int c = tid; c < BIAS_BYTES / 16; c += static_cast<int>(blockDim.x)) {
      const float n = static_cast<float>(8 * (c / 4));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(bias_tile() + 16u * c),
                   "r"(pack2<true>(n, n + 1.f)), "r"(pack2<true>(n + 2.f, n + 3.f)), "r"(pack2<true>(n + 4.f, n + 5.f)),
                   "r"(pack2<true>(n + 6.f, n + 7.f)) : "memory");
    }
    fence_proxy_async_smem();
  }
  // BIAS_GEMM's A fragment for the current tile (m64k16, as P's: register 0 holds row g's columns 2t, 2t + 1,
  // register 1 row g + 8's, registers 2 and 3 columns 2t + 8, 2t + 9): the slope over the scale x as three
  // bf16 parts, hi = x rounded, mid = (x - hi) rounded, lo = (x - hi - mid) rounded (each difference exact in
  // fp32), in columns 0, 1 (the lanes of t = 0) and 2 (t = 1), zeros elsewhere: hi + mid + lo = x exactly
  // (x's 24 bits, 8 a part; fp32's exponent range).
  FG_DEVICE void bias_frag(fg_u32 (&a)[4]) const {
    const float x = var.col_slope_of();
    const float hi = bf16_round(x), r = x - hi, mid = bf16_round(r);
    const fg_u32 w = t == 0 ? pack2<true>(hi, mid) : t == 1 ? pack2<true>(r - mid, 0.f) : 0u;
    a[0] = a[1] = w;
    a[2] = a[3] = 0u;
  }
  static FG_DEVICE float bf16_round(float x) { return __uint_as_float(pack2<true>(x, 0.f) << 16); }

  // ---- producer: the TMA loads (one thread) ----
  // Load K/V block j of this tile at ring position r (stage r % ST, use r / ST) once the consumers have
  // released that stage. Without PERSISTENT r = j (one tile per CTA).
  FG_DEVICE void produce_at(int r, int j) {
    const int s = r % ST;
    // Paged K/V: the block's block-table entries go to page_slot by 4-byte cp.async before the wait (their
    // latency hides behind it, and no register holds them across it: held in registers, they spilled
    // the persistent producer's 40 or 32).
    if constexpr (PAGE_ROWS > 0) {
#pragma unroll 1
      for (int c = 0; c < CHUNKS; ++c) {  // (rolled, here and in load_kv: unrolled, they spilled the producer)
        const int key = kv_block(j) * BN + c * PAGE_ROWS;
        if (key < seq_nk) cp_async_4(page_slot + 4u * c, p.bt + b * p.bt_stride + (key >> p.page_shift));
      }
      cp_async_commit();
    }
    if (r >= ST) mbar_wait(bar_e(s), ((r / ST) + 1) & 1);
    if constexpr (PAGE_ROWS > 0) cp_async_wait<0>();
    mbar_expect_tx(bar_k(s), KV_BYTES);
    load_kv(sK + s * KV_BYTES, &p.tm_k, bar_k(s), j);
    if constexpr (EARLY_K) {
      if (r >= ST) mbar_wait(bar_ev(s), ((r / ST) + 1) & 1);
    }
    mbar_expect_tx(bar_v(s), KV_BYTES);
    load_kv(sV + s * KV_BYTES, &p.tm_v, bar_v(s), j);
  }
  // The TMA copies of K (or V) block j into a stage at `dst`: one box of BN rows per 128-byte panel, or,
  // paged, CHUNKS boxes of PAGE_ROWS rows per panel (at 1024-byte multiples, so the swizzle is the one
  // a single box would give), box c from the page page_slot[c] names, at its row in the page. A box
  // wholly past the sequence's keys reads row `page size` of page 0: outside the map, so the TMA fills it
  // with zeros, and no block-table entry past the pages in use is read.
  FG_DEVICE void load_kv(fg_u32 dst, const fg_tmap* map, fg_u32 bar, int j) const {
    if constexpr (PAGE_ROWS > 0) {
#pragma unroll 1
      for (int c = 0; c < CHUNKS; ++c) {
        const int key = kv_block(j) * BN + c * PAGE_ROWS;
        const bool live = key < seq_nk;
        int page = 0;
        if (live) asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(page) : "r"(page_slot + 4u * c) : "memory");
        const int row = live ? key & ((1 << p.page_shift) - 1) : 1 << p.page_shift;
#pragma unroll
        for (int pn = 0; pn < PANELS; ++pn)
          tma_load_4d(dst + pn * BN * ROWB + c * PAGE_ROWS * ROWB, map, bar, pn * ROW_ELEMS, row, hk, page);
      }
    } else {
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn)
        tma_load_4d(dst + pn * BN * ROWB, map, bar, pn * ROW_ELEMS, k_off + kv_block(j) * BN, hk, map_batch());
    }
  }
  FG_DEVICE void produce(int j) { produce_at(j, j); }

  // Paged K/V of a one-tile-per-CTA warp-specialized kernel: the producer warp (lanes 0-31, `tid`) loads
  // block j with lane c < CHUNKS issuing box c's copies (its page's rows) and lane 0 the barriers'
  // expected bytes: the CHUNKS boxes go out side by side, not from one thread's loop (pages of 16, m192
  // n80: 0.77x -> 0.94x the contiguous call on the H200, docs/perf/varlen.md). Each lane reads its
  // block-table entry before the stage's empty wait (the latency hides there; one register a lane).
  FG_DEVICE void produce_lanes(int j) {
    const int s = j % ST, c = tid;
    const int key = kv_block(j) * BN + c * PAGE_ROWS;
    const bool mine = c < CHUNKS, live = mine && key < seq_nk;
    int page = 0;
    if (live) page = __ldg(p.bt + b * p.bt_stride + (key >> p.page_shift));
    const int row = live ? key & ((1 << p.page_shift) - 1) : 1 << p.page_shift;
    if (j >= ST) mbar_wait(bar_e(s), ((j / ST) + 1) & 1);
    if (c == 0) mbar_expect_tx(bar_k(s), KV_BYTES);
    __syncwarp();
    if (mine) {
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn)
        tma_load_4d(sK + s * KV_BYTES + pn * BN * 128 + c * PAGE_ROWS * 128, &p.tm_k, bar_k(s), pn * 64, row, hk, page);
    }
    if constexpr (EARLY_K) {
      if (j >= ST) mbar_wait(bar_ev(s), ((j / ST) + 1) & 1);
    }
    if (c == 0) mbar_expect_tx(bar_v(s), KV_BYTES);
    __syncwarp();
    if (mine) {
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn)
        tma_load_4d(sV + s * KV_BYTES + pn * BN * 128 + c * PAGE_ROWS * 128, &p.tm_v, bar_v(s), pn * 64, row, hk, page);
    }
  }

  // GATHER's producer (every thread of the producer warpgroup, `tid` 0-127): K/V block j row by row.
  // Thread c < CHUNKS reads block-table entry c before the stage's wait (its latency hides there) and
  // publishes it in page_slot's half j % 2 (the half block j - 2 used: every producer thread has passed
  // block j - 1's barrier, so none still reads it); the named barrier makes the entries visible.
  FG_DEVICE void gather_block(int j) {
    const int s = j % ST, key0 = kv_block(j) * BN;
    int page = 0;
    if (tid < CHUNKS && key0 + tid * PAGE_ROWS < seq_nk)
      page = __ldg(p.bt + b * p.bt_stride + ((key0 + tid * PAGE_ROWS) >> p.page_shift));
    if (j >= ST) mbar_wait(bar_e(s), ((j / ST) + 1) & 1);
    const fg_u32 slot = page_slot + 4u * ((j & 1) * CHUNKS);
    if (tid < CHUNKS) asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot + 4u * tid), "r"(page) : "memory");
    named_sync(1, 128);
    gather_rows(sK + s * KV_BYTES, p.kc, p.k_sb, p.k_sh, p.k_ss, slot, key0, bar_k(s));
    if constexpr (EARLY_K) {
      if (j >= ST) mbar_wait(bar_ev(s), ((j / ST) + 1) & 1);
    }
    gather_rows(sV + s * KV_BYTES, p.vc, p.v_sb, p.v_sh, p.v_ss, slot, key0, bar_v(s));
  }
  // This thread's GATHER_PER 16-byte chunks of a block (rows key0 ... key0 + BN - 1 of the sequence) into
  // the stage at `dst` in the layout a TMA box gives (128-byte panels of BN rows, chunk c of row r at
  // position c ^ (r % 8)); rows past the keys are zero-filled (nothing read). Counted on `bar` by one
  // asynchronous arrive once they have landed.
  FG_DEVICE void gather_rows(fg_u32 dst, const elem_t* base, long long s_page, long long s_head, long long s_row,
                             fg_u32 slot, int key0, fg_u32 bar) const {
    const elem_t* head = base + static_cast<long long>(hk) * s_head;
    auto chunk = [&](int i) {
      const int idx = tid + 128 * i, r = idx / CPR, c = idx % CPR, key = key0 + r;
      const bool live = key < seq_nk;
      int page = 0;
      if (live) asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(page) : "r"(slot + 4u * (r / PAGE_ROWS)) : "memory");
      const elem_t* src = head + page * s_page + (key & ((1 << p.page_shift) - 1)) * s_row + c * 8;
      cp_async_16(dst + (c / 8) * BN * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16), live ? src : base, live ? 16 : 0);
    };
    // (Rolled: 2, 4 or 8 chunks issued together per thread measured no faster, docs/perf/varlen.md.)
#pragma unroll 1
    for (int i = 0; i < GATHER_PER; ++i) chunk(i);
    cp_async_mbar_arrive_noinc(bar);
  }
  // The maps' batch coordinate: packed rows are one batch of total rows (a block that runs past its
  // sequence reads the next one's rows: masked keys, query rows never stored).
  FG_DEVICE int map_batch() const { return V::VARLEN_ROWS ? 0 : b; }
  // Warpgroup w's Q rows of the current tile into piece i (a box of 64 rows: rows past nq read zero).
  FG_DEVICE void produce_q_piece(int i, int w) {
    mbar_expect_tx(bar_qf(i), QW_BYTES);
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn)
      tma_load_4d(sQ + i * QW_BYTES + pn * 64 * ROWB, &p.tm_q, bar_qf(i), pn * ROW_ELEMS, q_off + m0 + 64 * w, hq,
                  map_batch());
  }
  FG_DEVICE void produce_q() {
#pragma unroll
    for (int w = 0; w < NWG; ++w) produce_q_piece(w, w);
  }
  // ---- FP8's producer warpgroup: warp 0 loads, warps 1-3 transpose V ----
  // wgmma takes FP8 operands K-major only, so P V needs V^T (d rows of keys) in shared memory; V arrives
  // by TMA as key rows. One thread issues every TMA (Q, K into the K ring, V into the VR raw buffers); the
  // 96 threads of warps 1-3 turn each raw V block into the V^T stage the consumers read (bar_v), then
  // free the raw buffer (bar_vre). V^T's key order inside every 16 keys is sigma (vt_keys): the one in
  // which the consumers' P registers, packed straight from S's accumulators, are wgmma's A fragment.
  FG_DEVICE void produce_fp8() {
    produce_q();
    for (int j = 0; j < n_blocks; ++j) {
      const int rb = j % VR, s = j % ST;
      if (j >= VR) mbar_wait(bar_vre(rb), ((j / VR) + 1) & 1);
      mbar_expect_tx(bar_vr(rb), KV_BYTES);
      load_kv(sVr + rb * KV_BYTES, &p.tm_v, bar_vr(rb), j);
      if (j >= ST) mbar_wait(bar_e(s), ((j / ST) + 1) & 1);
      mbar_expect_tx(bar_k(s), KV_BYTES);
      load_kv(sK + s * KV_BYTES, &p.tm_k, bar_k(s), j);
    }
  }
  // Byte offset of byte c of row r in a swizzled panel of RB-byte rows (the TMA's and wgmma's 128- or
  // 64-byte swizzle: 16-byte chunk c / 16 XOR bits 7.. of the row's address).
  template <int RB>
  static FG_DEVICE fg_u32 swz(int r, int c) {
    return static_cast<fg_u32>(r * RB + ((((c >> 4) ^ ((r * RB >> 7) & (RB / 16 - 1))) << 4) | (c & 15)));
  }
  // Transposing thread x (0-95): every V block of the tile. A warp step is 16 bytes of d (one swizzle
  // chunk) by a span of 128 keys, or two chunks by a span of 64 keys (BN = 64, and BN = 192 in three
  // spans): lane (kq, tq) of a chunk reads 16 bytes of d from each of keys 2tq, 2tq + 1, 2tq + 8,
  // 2tq + 9 of key group kq of the span (sigma's positions 4tq .. 4tq + 3; one 16-byte load a key), turns
  // each 4-byte column of those four words into one word of 4 keys (a 4 x 4 byte transpose, eight byte
  // permutes), and writes it to d row c + x at its group's positions 4tq .. 4tq + 3. A store's lanes all
  // write one row (two, with 64-key spans), each group's 16 bytes at another swizzle chunk: no bank
  // conflict (64-key spans: two-way); a load is two-way (the 8 lanes of a 16-byte access phase read rows
  // 16 apart in pairs, one swizzle phase each; reading the pairs of odd groups the other way round made
  // the loads conflict-free and measured no faster: docs/perf/fp8.md). One step moves 2 KB with 4 loads,
  // 16 stores and 32 permutes (a 4-byte-a-lane version spent ~100 instructions on 512 bytes, most of them
  // addresses, and held the FP8 forward at 0.7x the bf16 one on an H100 whatever the pipeline).
  FG_DEVICE void transpose_v(int x) {
    enum : int {
      KG = BN / 16,                    // key groups of 16
      KGS = KG == 8 ? 8 : 4,           // key groups a warp step covers (its span: 16 KGS keys)
      PER = 8 / KGS,                   // d chunks a warp step covers
      CSTEPS = (D / 16) / PER,         // warp steps per span
      STEPS = (KG / KGS) * CSTEPS,     // warp steps per block
    };
    const int w = x / 32, lane = x % 32, tq = lane % 4, kq = (lane / 4) % KGS, sub = lane / (4 * KGS);
    for (int j = 0; j < n_blocks; ++j) {
      const int rb = j % VR, s = j % ST;
      mbar_wait(bar_vr(rb), (j / VR) & 1);
      if (j >= ST) mbar_wait(bar_ev(s), ((j / ST) + 1) & 1);
      const fg_u32 src = sVr + rb * KV_BYTES, dst = sV + s * KV_BYTES;
#pragma unroll 1
      for (int st = w; st < STEPS; st += TRANSPOSERS / 32) {
        const int key0 = (st / CSTEPS) * KGS * 16 + kq * 16;  // this lane's key group (warp-uniform span)
        const int c = ((st % CSTEPS) * PER + sub) * 16;          // this lane's d bytes c .. c + 15
        if (VT_LAST != VT_ROWB && key0 >= BN / 128 * 128) transpose_chunk<VT_LAST>(src, dst, key0, c, tq);
        else transpose_chunk<VT_ROWB>(src, dst, key0, c, tq);
      }
      fence_proxy_async_smem();  // the generic writes before the consumers' wgmma reads them
      mbar_arrive(bar_v(s));
      mbar_arrive(bar_vre(rb));
    }
  }
  // One lane's part of a warp step: keys key0 + [2tq, 2tq + 1, 2tq + 8, 2tq + 9], d bytes c .. c + 15, from
  // the raw block at src into the V^T stage at dst, whose panel there has RBP-byte rows.
  template <int RBP>
  static FG_DEVICE void transpose_chunk(fg_u32 src, fg_u32 dst, int key0, int c, int tq) {
    const int pos = key0 + 4 * tq;  // sigma position of the lane's first key in V^T's rows
    const fg_u32 panel = src + (c / ROWB) * BN * ROWB, out_panel = dst + (pos / 128) * D * 128;
    fg_u32x4 in[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = key0 + 2 * tq + (i & 1) + 8 * (i >> 1);
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(in[i].x), "=r"(in[i].y), "=r"(in[i].z), "=r"(in[i].w)
                   : "r"(panel + swz<ROWB>(r, c % ROWB)) : "memory");
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // d bytes c + 4q .. c + 4q + 3
      const fg_u32 a = word_of(in[0], q), b = word_of(in[1], q), cc = word_of(in[2], q), d = word_of(in[3], q);
      fg_u32 t0, t1, t2, t3, out[4];
      asm("prmt.b32 %0, %1, %2, 0x5140;\n" : "=r"(t0) : "r"(a), "r"(b));
      asm("prmt.b32 %0, %1, %2, 0x7362;\n" : "=r"(t1) : "r"(a), "r"(b));
      asm("prmt.b32 %0, %1, %2, 0x5140;\n" : "=r"(t2) : "r"(cc), "r"(d));
      asm("prmt.b32 %0, %1, %2, 0x7362;\n" : "=r"(t3) : "r"(cc), "r"(d));
      asm("prmt.b32 %0, %1, %2, 0x5410;\n" : "=r"(out[0]) : "r"(t0), "r"(t2));
      asm("prmt.b32 %0, %1, %2, 0x7632;\n" : "=r"(out[1]) : "r"(t0), "r"(t2));
      asm("prmt.b32 %0, %1, %2, 0x5410;\n" : "=r"(out[2]) : "r"(t1), "r"(t3));
      asm("prmt.b32 %0, %1, %2, 0x7632;\n" : "=r"(out[3]) : "r"(t1), "r"(t3));
#pragma unroll
      for (int e = 0; e < 4; ++e)
        asm volatile("st.shared.b32 [%0], %1;\n"
                     ::"r"(out_panel + swz<RBP>(c + 4 * q + e, pos % 128)), "r"(out[e]) : "memory");
    }
  }
  static FG_DEVICE fg_u32 word_of(const fg_u32x4& v, int q) { return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w; }

  // PERSISTENT's producer: every tile of this CTA. `it` is the ring position of K/V block j of the tile
  // (counted on across tiles: stage it % ST, use it / ST), `qi` the tile's number in this CTA; use u of
  // Q piece i waits for use u - 1's 'Q empty' phase.
  FG_DEVICE void piece_free(int u) {  // u = qi * NWG + w: the u-th piece use of this CTA
    if (u >= QP) mbar_wait(bar_qe(u % QP), ((u / QP) + 1) & 1);
  }
  FG_DEVICE void produce_all() {
    if constexpr (PERSISTENT) {
    int it = 0;
    for (int qi = 0;; ++qi) {
      if (qi > 0) tile = static_cast<int>(gridDim.x) + atomicAdd(p.sched, 1);
      if (tile >= n_tiles) {  // none left: tell each consumer on its next piece
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
          // The tile (one slot per tile, not per piece: see fwd_sm90_body) once its Q pieces are free.
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
  }

  // ---- consumer: the main loop over one tile's K/V blocks ----
  // Offsets (in 16-byte units) for k step kk (32 bytes of each row) inside a K-major tile of `rows` rows
  // in panels of RB-byte rows.
  template <int RB = ROWB>
  static FG_DEVICE fg_u64 kmajor_off(int kk, int rows) {
    return static_cast<fg_u64>((((kk * 32) / RB) * rows * RB + (kk * 32) % RB) >> 4);
  }

  // Ping-pong: each warpgroup's GEMM issues form "sections"; consumer 0 goes
  // first, then they take turns (0, 1[, 2], 0, ...). All run the same number of
  // sections per tile. One tile per CTA: the last arrive of the last consumer is
  // skipped so every barrier phase completes. PERSISTENT: the turns run on into the
  // next tile (consumer 0 starts it while the others finish this one), and
  // consumer 0 takes the last one when no tile is left.
  FG_DEVICE void pp_begin() const {
    if constexpr (PINGPONG) named_sync(6 + cw, 256);
  }
  FG_DEVICE void pp_end(bool last) const {
    if constexpr (PINGPONG) {
      if (PERSISTENT || !(last && cw == NWG - 1)) named_arrive(6 + (NWG == 2 ? (cw ^ 1) : (cw + 1) % NWG), 256);
    }
  }

  // S = Q K^T of stage s; BIAS_GEMM: then S += A B^T, the bias's column part (ba: bias_frag).
  FG_DEVICE void issue_s(float (&acc_s)[BN / 2], int s, const fg_u32 (&ba)[4]) const {
    const fg_u64 dk = desc_k + static_cast<fg_u64>((s * KV_BYTES) >> 4);
#pragma unroll
    for (int kk = 0; kk < D / KSTEP; ++kk) fg_wgmma_qk(acc_s, desc_q + kmajor_off(kk, 64), dk + kmajor_off(kk, BN), kk);
    if constexpr (BIAS_GEMM) fg_wgmma_bias(acc_s, ba, smem_desc(bias_tile(), 64, 64, 0));
  }
  FG_DEVICE void issue_pv(float (&acc_o)[D / 2], const fg_u32 (&pa)[KV_STEPS][4], int s) const {
    const fg_u64 stage = static_cast<fg_u64>((s * KV_BYTES) >> 4), dv = desc_v + stage;
#pragma unroll
    for (int kk = 0; kk < KV_STEPS; ++kk) {
      if constexpr (FP8) {  // V^T: K-major, d rows of keys, panels of 128 keys (the last maybe narrower)
        const bool last = VT_LAST != VT_ROWB && (kk * 32) / 128 == BN / 128;
        fg_wgmma_pv(acc_o, pa[kk], (last ? desc_vl : desc_v) + stage + kmajor_off<128>(kk, D));
      }
      else  // V: MN-major, k16 steps of 16 key rows
        fg_wgmma_pv(acc_o, pa[kk], dv + static_cast<fg_u64>((kk * 16 * 128) >> 4));
    }
  }

  // P = exp2(s scale_log2 - m_scaled) in place for row half h, its sum added to sum[0]: exp2_row
  // (softmax.cuh) but with FMA_EXP2 of every 8 n8 chunks on the FMA pipe and, LEAN, two partial sums
  // (sum[e] for the even / odd column of each pair: half the dependent FADD chain). Local to this
  // kernel: its arithmetic differs.
  static FG_DEVICE void exp2_row_mixed(float (&s)[BN / 2], int h, float scale_log2, float m_scaled, float (&sum)[2]) {
#pragma unroll
    for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = fmaf(s[4 * nj + 2 * h + e], scale_log2, -m_scaled);
        // FMA_EXP2 of every 8 n8 chunks (nj = 7; 3, 7; odd) on the FMA pipe; nj is a constant once unrolled.
        const float pe = (nj * FMA_EXP2) % 8 >= 8 - FMA_EXP2 ? exp2_fma(x) : fast_exp2(x);
        s[4 * nj + 2 * h + e] = pe;
        sum[LEAN ? e : 0] += pe;
      }
  }
  // The variant's score transforms (softcap, ALiBi), the mask (only where block j crosses the key end
  // or one of this warpgroup's rows' visible range), then the online-softmax update: acc_s becomes P
  // (fp32), alpha the factor by which O must be rescaled (applied by the caller when O is not in flight).
  // ALIBI_LINEAR (causal ALiBi): the scores leave transform_cols without their row part off = slope (c0 -
  // row - diag) (variant.cuh), which joins the thread's block max before the quad max and the exp2's offset:
  // exp2((s + off) scale_log2 - m_scaled) = exp2(s scale_log2 - (m_scaled - off scale_log2)). One FFMA per
  // score instead of an FADD and an FFMA; none with BIAS_GEMM, whose S has the column part from the GEMM
  // (off = slope (n0 - row - diag)).
  // Whether key block j (keys from n0) needs masking for this warpgroup's rows: a block mask's partial
  // flag (or the key end), else the variant's range test.
  FG_DEVICE bool block_needs_mask(int j, int n0) const {
    if constexpr (V::SPARSE) return var.partial_at(j) || n0 + BN > var.nk;
    else return var.needs_mask(n0, BN, m0 + cw * 64, m0 + cw * 64 + 63);
  }
  FG_DEVICE void softmax(int j, float (&acc_s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                         float (&alpha)[2]) const {
    const int n0 = kv_block(j) * BN;
    if constexpr (V::ALIBI_LINEAR) {
      if constexpr (!BIAS_GEMM) {  // (BIAS_GEMM: S's GEMM has added the column part)
#pragma unroll
        for (int h = 0; h < 2; ++h) var.transform_cols(acc_s, h);
      }
    } else if constexpr (V::TRANSFORMS) {
#pragma unroll
      for (int h = 0; h < 2; ++h) var.transform(acc_s, h, row_base + 8 * h, n0 + 2 * t);
    }
    if (block_needs_mask(j, n0)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) var.mask(acc_s, h, row_base + 8 * h, n0 + 2 * t);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx;
      // (BIAS_GEMM: S holds the slope times the key's column in the block, so the rest is from key n0 on)
      const float off = var.alibi_row_offset(row_base + 8 * h, BIAS_GEMM ? n0 : n0 + 2 * t);
      // The row max as a tree at d = 64 and with LEAN (a chain elsewhere: the same value, bit for bit):
      // at d = 64 the GEMMs are short and the chain's latency showed (H100, docs/perf/fp8.md: FP8
      // +2-9 %, bf16 +1-4 %); at d = 128 and 256 the tree measured within the spread (0.95-1.03x).
      if constexpr (V::ALIBI_LINEAR)
        mx = fmaxf(row_max[h], (TREE_MAX ? tree_row_max(acc_s, h, -INFINITY) : fold_row_max(acc_s, h, -INFINITY)) + off);
      else if constexpr (TREE_MAX)
        mx = tree_row_max(acc_s, h, row_max[h]);
      else
        mx = fold_row_max(acc_s, h, row_max[h]);
      mx = quad_max(mx);
      // LEAN: keep the old max unless this one is more than 2^8 above it (in P = 2^(scaled s - m)). The
      // scale is positive (api.checked_scale): a first finite max over -inf reads +inf and moves; both -inf
      // reads NaN and stays.
      if constexpr (LEAN) mx = (mx - row_max[h]) * sl2() > 8.f ? mx : row_max[h];
      const float m_scaled = max_scaled(mx, sl2());  // all masked so far: no NaN
      if constexpr (LEAN)  // exactly 1 where the max stayed (O, l are 0 while it is -inf: any factor does)
        alpha[h] = mx == row_max[h] ? 1.f : rescale_factor(row_max[h], m_scaled, sl2());
      else
        alpha[h] = rescale_factor(row_max[h], m_scaled, sl2());
      row_max[h] = mx;
      float sum[2] = {0.f, 0.f};
      exp2_row_mixed(acc_s, h, sl2(), V::ALIBI_LINEAR ? fmaf(-off, sl2(), m_scaled) : m_scaled, sum);
      // per-thread partial; quad-summed at the end
      row_sum[h] = row_sum[h] * alpha[h] + (LEAN ? sum[0] + sum[1] : sum[0]);
    }
  }
  // O times alpha, both rows in one pass (softmax.cuh's rescale_row once per row does the same multiplies
  // in another order, which the compiler schedules differently).
  FG_DEVICE void rescale_o(float (&acc_o)[D / 2], const float (&alpha)[2]) const {
    // LEAN: alpha is exactly 1 for a row whose max did not move; skip when that holds for the warp.
    if constexpr (LEAN) {
      if (!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) return;
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      acc_o[4 * i] *= alpha[0];
      acc_o[4 * i + 1] *= alpha[0];
      acc_o[4 * i + 2] *= alpha[1];
      acc_o[4 * i + 3] *= alpha[1];
    }
  }
  // P as A fragments: k16 step kk takes n8 chunks 2kk and 2kk+1 of S. FP8: k32 step kk takes chunks
  // 4kk .. 4kk + 3, rounded to e4m3 (satfinite) in the registers' order as they are: register 0 holds
  // row g's columns 2t, 2t + 1 of chunks 4kk and 4kk + 1, which wgmma reads as keys 4t .. 4t + 3 of the
  // step; V^T's key order (sigma, transpose_v) puts the matching V rows there.
  static FG_DEVICE void pack_p(fg_u32 (&pa)[KV_STEPS][4], float (&acc_s)[BN / 2]) {
#pragma unroll
    for (int kk = 0; kk < KV_STEPS; ++kk) {
      if constexpr (FP8) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int c = 4 * (4 * kk + 2 * (r >> 1)) + 2 * (r & 1);  // chunk 4kk (+2), row half r & 1
          pa[kk][r] = pack4_e4m3(acc_s[c], acc_s[c + 1], acc_s[c + 4], acc_s[c + 5]);
        }
      } else {
        p_frag<BF16>(pa[kk], acc_s, kk);
      }
    }
  }
  // Debug (p.dbg_s != null, bench/smoke_sm90.py --isolated): the raw S = Q K^T of key block 0 of
  // query block 0 (batch 0, head 0), unscaled and unmasked, as fp32 [BM][BN] rows (BIAS_GEMM: with the
  // bias's column part, the slope times the column).
  FG_DEVICE void dump_s(const float (&acc_s)[BN / 2]) const {
    if (p.dbg_s != nullptr && m_block == 0 && hq == 0 && b == 0) {
      const int r = cw * 64 + wq * 16 + g;
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) p.dbg_s[(r + 8 * h) * BN + nj * 8 + 2 * t + e] = acc_s[4 * nj + 2 * h + e];
    }
  }
  // K of block j once S(j) has completed (EARLY_K only; else K goes with V in release). release_k and
  // release take the block's ring position (kv0 + j; j itself without PERSISTENT).
  FG_DEVICE void release_k(int j) const {
    if constexpr (EARLY_K) {
      if (lane == 0) mbar_arrive(bar_e(j % ST));
    }
  }
  // V (and, without EARLY_K, K) of block j once P(j) V(j) has completed.
  FG_DEVICE void release(int j) {
    if (lane == 0) mbar_arrive(bar_ev(j % ST));
    if constexpr (!WS) {
      // (& rather than &&: the same code as when this was inline; as a function, && came out as two branches.)
      if ((tid == 0) & (j + ST < n_blocks)) produce(j + ST);
    }
  }

  // This tile's main loop (consumer warpgroup cw, Q piece qp, kv0 the ring position of the tile's first
  // K/V block), then its epilogue. s_carry: S's registers, which the body keeps across tiles, copied in
  // and out (wgmma reads its accumulators: in a PERSISTENT kernel the previous tile's S flows into the
  // next tile's first S = Q K^T, as it did when this was inline; with a fresh array the compiler
  // allocates the registers differently).
  static FG_DEVICE void consume_tile(const fwd_sm90_cta& cta, const Params& p, int qp, int kv0,
                                     float (&s_carry)[BN / 2]) {
    // c: this tile's copy of the CTA's state, a local (so the compiler keeps its fields in registers
    // through the loops below, as it did before the split), with the tile's own values added.
    fwd_sm90_cta c = cta;
    c.qp = qp;
    c.sQw = c.sQ + qp * QW_BYTES;  // this warpgroup's Q rows
    // The CTA's loop runs n_blocks K/V blocks (every stage's barriers go through all of them); this
    // warpgroup computes only the first n_live: none when its 64 rows are all past the queries (the last
    // m-block of a 192-row tile at N = 2k), and under causal masking not the blocks wholly above its own
    // diagonal (they would add exp2(-inf) = 0). A skipped block issues no wgmma and runs no softmax.
    c.n_live = c.blocks_for(c.m0 + c.cw * 64, 64);
    c.row_base = c.m0 + c.cw * 64 + c.wq * 16 + c.g;  // this thread's rows: row_base and row_base + 8

    // Descriptors: K-major SW128 (LBO 16 B, unused; SBO 1024 B) for Q and K,
    // MN-major SW128 (LBO = panel stride, SBO = 1024 B) for V.
    c.desc_q = sw_desc<ROWB>(c.sQw);
    c.desc_k = sw_desc<ROWB>(c.sK);
    if constexpr (FP8) {  // V^T: K-major
      // (from lane 0: else ptxas rebuilds the last P V's descriptors per thread, an R2UR before each wgmma)
      const fg_u32 sv = __shfl_sync(0xffffffffu, c.sV, 0);
      c.desc_v = sw_desc<VT_ROWB>(sv);
      c.desc_vl = sw_desc<VT_LAST>(sv);
    }
    else c.desc_v = sw128_desc(c.sV, BN * 128, 1024);

    float acc_o[D / 2];
    float acc_s[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc_s[i] = s_carry[i];
    fg_u32 pa[KV_STEPS][4];
    fg_u32 ba[4];  // BIAS_GEMM: the slope's A fragment (its head's)
    if constexpr (BIAS_GEMM) c.bias_frag(ba);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f}, alpha[2] = {1.f, 1.f};
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc_o[i] = 0.f;

    if constexpr (PINGPONG && !PERSISTENT) {
      if (c.cw == NWG - 1 && c.n_blocks > 0) named_arrive(6, 256);
    }

    // Always (PERSISTENT: at the top): the epilogue reuses the Q rows, so the Q copy must have landed.
    if constexpr (!PERSISTENT) mbar_wait(c.bar_qf(qp), 0);

    // Two loop shapes. Without overlap or ping-pong: S(j), softmax, P(j)V(j), each GEMM waited on.
    // With either: one GEMM section per iteration, S(j) and P(j-1)V(j-1) issued together (one named-
    // barrier turn per iteration under ping-pong, so the other warpgroup's section runs during this
    // one's softmax). OVERLAP then runs softmax(j) between the two waits (P(j-1)V(j-1) in flight);
    // without it both GEMMs are waited on first.
    if constexpr (!OVERLAP && !PINGPONG) {
      for (int j = 0; j < c.n_live; ++j) {
        const int s = (kv0 + j) % ST, ph = ((kv0 + j) / ST) & 1;
        c.kv_wait(c.bar_k(s), ph);
        c.pp_begin();
        wgmma_fence();
        c.issue_s(acc_s, s, ba);
        wgmma_commit();
        c.pp_end(false);
        wgmma_wait<0>();
        reg_fence(acc_s);
        c.release_k(kv0 + j);
        if (j == 0) c.dump_s(acc_s);
        c.softmax(j, acc_s, row_max, row_sum, alpha);
        c.rescale_o(acc_o, alpha);
        c.pack_p(pa, acc_s);
        c.kv_wait(c.bar_v(s), ph);
        c.pp_begin();
        reg_fence(acc_o);
        wgmma_fence();
        c.issue_pv(acc_o, pa, s);
        wgmma_commit();
        c.pp_end(j == c.n_blocks - 1);
        wgmma_wait<0>();
        reg_fence(acc_o);
        c.release(kv0 + j);
      }
    } else if (c.n_live > 0) {
      c.kv_wait(c.bar_k(kv0 % ST), (kv0 / ST) & 1);
      c.pp_begin();
      wgmma_fence();
      c.issue_s(acc_s, kv0 % ST, ba);
      wgmma_commit();
      c.pp_end(false);
      wgmma_wait<0>();
      reg_fence(acc_s);
      c.release_k(kv0);
      c.dump_s(acc_s);
      c.softmax(0, acc_s, row_max, row_sum, alpha);  // O is still zero: no rescale needed
      for (int j = 1; j < c.n_live; ++j) {
        const int r = kv0 + j, s = r % ST, sp = (r - 1) % ST;
        c.pack_p(pa, acc_s);  // P(j-1)
        c.kv_wait(c.bar_k(s), (r / ST) & 1);
        c.kv_wait(c.bar_v(sp), ((r - 1) / ST) & 1);
        c.pp_begin();
        reg_fence(acc_o);
        wgmma_fence();
        c.issue_s(acc_s, s, ba);
        wgmma_commit();
        c.issue_pv(acc_o, pa, sp);
        wgmma_commit();
        c.pp_end(false);
        if constexpr (OVERLAP) {
          wgmma_wait<1>();  // S(j) done; P(j-1) V(j-1) may still run
          reg_fence(acc_s);
          c.release_k(r);
          c.softmax(j, acc_s, row_max, row_sum, alpha);
          // ptxas schedules WARPGROUP.DEPBAR as early as it may: without this pin the wait below
          // lands before the softmax's exp2s (SASS), and P(j-1)V(j-1) never overlaps them.
          sched_pin(row_sum[0] + row_sum[1], c.pin_slot);
          wgmma_wait<0>();
          reg_fence(acc_o);
          c.release(r - 1);
        } else {
          wgmma_wait<0>();
          reg_fence(acc_o);
          c.release_k(r);
          c.release(r - 1);  // stage j-1 is free before the softmax, not after it
          reg_fence(acc_s);
          c.softmax(j, acc_s, row_max, row_sum, alpha);
        }
        c.rescale_o(acc_o, alpha);
      }
      const int jl = kv0 + c.n_live - 1, sl = jl % ST;
      c.pack_p(pa, acc_s);
      c.kv_wait(c.bar_v(sl), (jl / ST) & 1);
      c.pp_begin();
      reg_fence(acc_o);
      wgmma_fence();
      c.issue_pv(acc_o, pa, sl);
      wgmma_commit();
      c.pp_end(c.n_live == c.n_blocks);
      wgmma_wait<0>();
      reg_fence(acc_o);
      c.release(jl);
    }

    // The blocks past n_live: waited on and released like the others, and under ping-pong one turn each
    // (every consumer takes n_blocks + 1 turns per tile: with none live, one more for the S(0) turn).
    if (c.n_live < c.n_blocks) {
      if (c.n_live == 0) {
        c.pp_begin();
        c.pp_end(false);
      }
      for (int j = c.n_live; j < c.n_blocks; ++j) {
        const int r = kv0 + j, s = r % ST, ph = (r / ST) & 1;
        c.kv_wait(c.bar_k(s), ph);
        c.kv_wait(c.bar_v(s), ph);
        c.pp_begin();
        c.pp_end(j == c.n_blocks - 1);
        c.release_k(r);
        c.release(r);
      }
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s_carry[i] = acc_s[i];
    c.epilogue(p, acc_o, row_max, row_sum);
  }

  // With a sink and p.o32 set (a gradient will be needed): this thread's elements of row half h of the
  // normalised O in fp32 into o32 (b, heads, nq, d), for the backward's D = rowsum(dO O) (with a sink O is
  // no multiple of one V row where P nears 1, and D from the rounded O cancels: docs/perf/variants.md).
  FG_DEVICE void store_o32(const Params& p, const float (&acc_o)[D / 2], int h, int row, float inv) const {
    if (p.o32 == nullptr || row >= var.nq) return;
    float* dst = p.o32 + (row_index() + row) * p.d;
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      if (8 * i + 2 * t < p.d)
        *reinterpret_cast<float2*>(dst + 8 * i + 2 * t) =
            make_float2(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
  }

  // The LSE's (and o32's) index of the tile's row 0: (b, heads, nq) rows, packed rows (heads, total_q).
  FG_DEVICE fg_i64 row_index() const {
    if constexpr (V::VARLEN_ROWS) return static_cast<fg_i64>(hq) * p.nq + q_off;
    return (static_cast<fg_i64>(b) * p.heads + hq) * p.nq;
  }

  // The end of row half h: its sum l (quad-summed), 1 / l (with a sink: the sink in the denominator) and,
  // with a sink, the LSE.
  FG_DEVICE void row_end(const float (&row_max)[2], const float (&row_sum)[2], int h, float& l, float& inv,
                         float& lse_sink) const {
    l = quad_sum(row_sum[h]);
    if constexpr (V::HAS_SINK) var.finish(row_max[h], l, lse_scale(), inv, lse_sink);
    else inv = row_inv(l);
  }
  // One row's LSE (written out, not softmax.cuh's row_lse: row_max is memory here, and row_lse's arguments
  // would be loaded before the test of l, which changes the code).
  FG_DEVICE void store_lse(const Params& p, fg_i64 at, float m, float l, float lse_sink) const {
    if constexpr (V::HAS_SINK) p.lse[at] = lse_sink;
    else p.lse[at] = l > 0.f ? m * lse_scale() + logf(l) : -INFINITY;
  }

  // ---- epilogue: normalise, stage O in this warpgroup's own Q rows, store ---
  FG_DEVICE void epilogue(const Params& p, const float (&acc_o)[D / 2], const float (&row_max)[2],
                          const float (&row_sum)[2]) const {
    if constexpr (FP8) {
      epilogue_direct(p, acc_o, row_max, row_sum);
      return;
    }
    // PERSISTENT: the thread index through an opaque move, so that the compiler cannot compute the O store
    // loop's row / chunk / swizzle indices (tile-invariant) once before the tile loop and keep them live
    // through every main loop (it did: 56 B of spills at d=128 192x80, 160 registers per consumer thread).
    int ltid_e = ltid;
    if constexpr (PERSISTENT) asm volatile("mov.b32 %0, %0;\n" : "+r"(ltid_e));
    named_sync(2 + cw, 128);  // every warp of this warpgroup is done reading its Q rows
    const fg_i64 lse_base = row_index();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l, inv, lse_sink;
      row_end(row_max, row_sum, h, l, inv, lse_sink);
      const int r = wq * 16 + g + 8 * h;  // row within this warpgroup's piece
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const fg_u32 packed = pack2<BF16>(acc_o[4 * i + 2 * h] * inv, acc_o[4 * i + 2 * h + 1] * inv);
        const fg_u32 addr = sQw + (i / 8) * 64 * 128 + r * 128 + (((i % 8) ^ (r % 8)) * 16) + 4 * t;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
      }
      const int row = row_base + 8 * h;
      if constexpr (V::HAS_SINK) store_o32(p, acc_o, h, row, inv);
      if (p.lse != nullptr && t == 0 && row < var.nq) store_lse(p, lse_base + row, row_max[h], l, lse_sink);
    }
    named_sync(2 + cw, 128);
    elem_t* o = p.o + (V::VARLEN_ROWS ? q_off * p.o_ss : b * p.o_sb) + hq * p.o_sh;
    constexpr int CH = 64 * (D / 8);  // 16-byte chunks of this warpgroup's 64 rows
#pragma unroll
    for (int it = 0; it < CH / 128; ++it) {
      const int i = it * 128 + ltid_e;
      const int rl = i / (D / 8), c = i % (D / 8);
      const int row = m0 + cw * 64 + rl;
      if (row < var.nq && c * 8 < p.d) {
        fg_u32x4 val;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                     : "r"(sQw + (c / 8) * 64 * 128 + rl * 128 + (((c % 8) ^ (rl % 8)) * 16))
                     : "memory");
        *reinterpret_cast<fg_u32x4*>(o + static_cast<fg_i64>(row) * p.o_ss + c * 8) = val;
      }
    }
  }
  // FP8's epilogue: O from the registers straight to global memory, two elements a store (its Q piece,
  // half O's bytes, cannot stage it; O's writes are small next to the K/V the tile reads), V's descale
  // joining the normalisation.
  FG_DEVICE void epilogue_direct(const Params& p, const float (&acc_o)[D / 2], const float (&row_max)[2],
                                 const float (&row_sum)[2]) const {
    const fg_i64 lse_base = row_index();
    elem_t* o = p.o + b * p.o_sb + hq * p.o_sh;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l, inv, lse_sink;
      row_end(row_max, row_sum, h, l, inv, lse_sink);
      const float iv = inv * f8_v;
      const int row = row_base + 8 * h;
      if (row < var.nq) {
        elem_t* dst = o + static_cast<fg_i64>(row) * p.o_ss + 2 * t;
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          if (8 * i + 2 * t < p.d)
            *reinterpret_cast<fg_u32*>(dst + 8 * i) = pack2<BF16>(acc_o[4 * i + 2 * h] * iv, acc_o[4 * i + 2 * h + 1] * iv);
        if (p.lse != nullptr && t == 0) store_lse(p, lse_base + row, row_max[h], l, lse_sink);
      }
    }
  }
};

// The kernel: the shared memory, the barriers, the warp roles (producer, consumers) and the consumers'
// tile loop; the stages are fwd_sm90_cta's.
template <int D, int BM, int BN, int ST, bool WS, bool PINGPONG, bool OVERLAP, bool CAUSAL, bool BF16,
          int PRODUCER_REGS, int CONSUMER_REGS, int FMA_EXP2, bool EARLY_K, bool LEAN, bool PERSISTENT, int QP,
          int PAGE_ROWS, bool GATHER, bool FP8, bool BIAS_GEMM, typename V, typename Params>
FG_DEVICE void fwd_sm90_body(const Params& p) {
  constexpr int NWG = BM / 64;  // consumer warpgroups
  static_assert(BM % 64 == 0 && D % 64 == 0 && BN % 16 == 0 && ST >= 2, "bad fwd_sm90 tile");
  static_assert(!PINGPONG || NWG == 2 || NWG == 3, "ping-pong takes two or three consumer warpgroups");
  static_assert(!EARLY_K || WS, "separate K/V empty barriers need the producer warpgroup");
  static_assert(FMA_EXP2 == 0 || FMA_EXP2 == 1 || FMA_EXP2 == 2 || FMA_EXP2 == 4,
                "fma_exp2: eighths of the columns (0, 1, 2, 4)");
  static_assert(!PERSISTENT || WS, "the persistent kernel needs the producer warpgroup");
  static_assert(QP == NWG || (PERSISTENT && QP > NWG && QP <= 2 * NWG),
                "Q pieces: NWG, or up to 2 NWG when persistent");
  constexpr int NBAR = EARLY_K ? 4 : 3;  // barriers per stage

  // Packed rows, one tile per CTA: a CTA past the device-built list has nothing to do (the grid is the
  // host's bound on the list).
  if constexpr (V::VARLEN_ROWS && !PERSISTENT) {
    if (static_cast<int>(blockIdx.x) >= p.vl_tiles[0] * p.heads) return;
  }
  extern __shared__ unsigned char smem_raw[];
  // The barriers (fwd_sm90_cta::bar_*): per Q piece, per stage, the sched_pin target, per Q piece.
  // Paged K/V: then the producer's block-table entries of the block it loads (fwd_sm90_cta::page_slot;
  // GATHER: two blocks' worth).
  __shared__ __align__(8) fg_u64 bars[QP + NBAR * ST + 1 + (PERSISTENT ? QP : 0) + (FP8 ? 4 : 0) + (PAGE_ROWS ? (GATHER ? BN / PAGE_ROWS : (BN / PAGE_ROWS + 1) / 2) : 0)];
  // PERSISTENT: the tile of the CTA's tile number qi in tile_slot[qi % 2], -1 when none is left. Written once
  // the tile's Q pieces are free, i.e. once every consumer is done with tile qi - 1 or qi - 2 (see
  // produce_all): the slot it overwrites (qi - 2's) has been read by all. One slot per tile, not per
  // piece, so that the tile (and every index the main loop derives from it) stays warp-uniform for the
  // compiler: a per-warpgroup slot made the K/V stage, barrier and descriptor values per-thread, with
  // 4 R->UR moves before every wgmma (SASS) and 8-15 % of the persistent kernel's speed lost (H200).
  __shared__ int tile_slot[PERSISTENT ? 2 : 1];
  using cta_t = fwd_sm90_cta<D, BM, BN, ST, WS, PINGPONG, OVERLAP, CAUSAL, BF16, FMA_EXP2, EARLY_K, LEAN,
                             PERSISTENT, QP, PAGE_ROWS, GATHER, FP8, BIAS_GEMM, V, Params>;
  cta_t cta(p, smem_addr(smem_raw), smem_addr(bars), tile_slot);
  const int tid = cta.tid;

  if constexpr (BIAS_GEMM) cta.fill_bias_tile();
  if (tid == 0) cta.init_barriers();
  __syncthreads();

  // The consumer warpgroup index, and below each tile number, pass through __shfl_sync from lane 0: the
  // compiler then knows them warp-uniform, and so every K/V stage, mbarrier address and wgmma descriptor
  // derived from them lives in uniform registers. Read plainly, the Q piece index (cw-dependent) made
  // them per-thread values with 2-4 R2UR moves before every wgmma (SASS: 126 R2URs in the persistent
  // kernel, 33 with the broadcast; 88 -> 9 in the one-tile kernel), and the persistent kernel lost 8-15 %.
  int cw;  // consumer warpgroup index
  constexpr bool LANES = PAGE_ROWS > 0 && WS && !PERSISTENT && !GATHER;  // paged: produce_lanes
  if constexpr (WS) {
    const int wg = tid / 128;
    if (wg == 0) {
      if constexpr (NWG >= 2) regs_dec<PRODUCER_REGS>();
      if constexpr (FP8) {
        if (tid == 0) cta.produce_fp8();
        else if (tid >= 32) cta.transpose_v(tid - 32);
      } else if constexpr (GATHER) {
        if (tid == 0) cta.produce_q();
        for (int j = 0; j < cta.n_blocks; ++j) cta.gather_block(j);
        cp_async_commit();  // (no thread leaves with its copies in flight)
        cp_async_wait<0>();
      } else if constexpr (LANES) {
        if (tid < 32) {
          if (tid == 0) cta.produce_q();
          for (int j = 0; j < cta.n_blocks; ++j) cta.produce_lanes(j);
        }
      } else if (tid == 0) {
        if constexpr (PERSISTENT) {
          cta.produce_all();
        } else {
          cta.produce_q();
          for (int j = 0; j < cta.n_blocks; ++j) cta.produce(j);
        }
      }
      return;
    }
    if constexpr (NWG >= 2) regs_inc<CONSUMER_REGS>();
    cw = __shfl_sync(0xffffffffu, wg, 0) - 1;
  } else {
    cw = __shfl_sync(0xffffffffu, tid / 128, 0);
    if (tid == 0) {
      cta.produce_q();
      for (int j = 0; j < ST && j < cta.n_blocks; ++j) cta.produce(j);
    }
  }

  cta.cw = cw;
  cta.ltid = tid % 128, cta.wq = cta.ltid / 32, cta.lane = tid % 32;
  cta.g = cta.lane / 4, cta.t = cta.lane % 4;
  // PERSISTENT: the ring position of this tile's first K/V block, and the tile's position in the Q ring
  // (both stay 0 without it: one tile per CTA).
  int kv0 = 0, qi = 0;
  // PERSISTENT + PINGPONG: the turns run on across tiles (see pp_end); the first turn is given here once.
  if constexpr (PERSISTENT && PINGPONG) {
    if (cw == NWG - 1) named_arrive(6, 256);
  }
  while (true) {  // tiles of this CTA (one pass when not persistent)
    const int qp = (qi * NWG + cw) % QP;  // this warpgroup's Q piece for this tile
    if constexpr (PERSISTENT) {  // the next tile, from the producer (with its Q)
      mbar_wait(cta.bar_qf(qp), ((qi * NWG + cw) / QP) & 1);
      cta.tile = __shfl_sync(0xffffffffu, tile_slot[qi % 2], 0);
      if (cta.tile < 0) {
        // Ping-pong: the last consumer's last turn went to the first one, who takes it here so that
        // every named-barrier phase completes.
        if constexpr (PINGPONG) {
          if (cw == 0) named_sync(6, 256);
        }
        break;
      }
      if (qi > 0) cta.take_tile();
    }
    float acc_s[BN / 2];  // (consume_tile: s_carry)
    cta_t::consume_tile(cta, p, qp, kv0, acc_s);
    if constexpr (PERSISTENT) {
      // This warp has read its O rows back out of the Q buffer: the producer may refill it (the proxy
      // fence orders this thread's generic st.shared before the TMA's async-proxy write of the next Q).
      fence_proxy_async_smem();
      __syncwarp();
      if (cta.lane == 0) mbar_arrive(cta.bar_qe(qp));
      kv0 += cta.n_blocks;
      ++qi;
    } else {
      break;
    }
  }  // tiles
}
