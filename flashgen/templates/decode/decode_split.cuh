// Flash-Decoding on mma.sync (sm_80+): one split of one sequence's keys.
//
// grid = (num_splits * m_blocks, heads_kv, batch). A CTA owns 16 packed query
// rows -- row r is new token r / group of query head hk*group + r % group, so
// the query heads that share a KV head read each K/V block once -- and the key
// blocks [s*bps, (s+1)*bps) of its sequence (bps = blocks per split, from the
// sequence's own length). Decode is memory-bound: the K/V blocks stream
// through an ST-stage cp.async ring (16-byte copies; K and V of a block are two
// commit groups, so the wait for K_j leaves V_j and the later blocks in
// flight) and every warp works on its own block_n/NW-key slice of each block,
// with its own online softmax; the warps merge through shared memory at the end.
//
// Loads: a block that lies wholly in the cache (the common case) takes the fast
// path -- no per-row checks; a contiguous cache's block is one run of rows, walked
// by one pointer (one 64-bit multiply per block), a paged cache's has one base
// pointer per 16-row group (its page); the last block of a split and blocks with
// appended keys take the checked path. Q's mma fragments (D = 128) stay in
// registers for the whole block loop. KV_LOAD picks the global-load flavour:
// 0 plain cp.async.cg, 1 with the .L2::256B prefetch hint, 2 with an
// evict_first L2 cache policy (the stream is read once), 3 both.
//
// KV_LOAD 4 and 5 (sm_90 only): the bulk loader. Each warp loads exactly the K/V
// rows it computes on (its block_n/NW-key slice), one cp.async.bulk per row
// (d*2 bytes: 256 at d=128) issued by one lane, completing on the warp's own
// mbarriers (one for K, one for V, per ring stage), 5 with the evict_first L2
// policy. A warp never waits for another one inside the block loop: no
// __syncthreads there at all. Bulk copies cannot swizzle, so the ring's rows
// are padded by 16 bytes instead (row pitch 2*D + 16: eight rows at one chunk
// column fall in eight bank groups, as the XOR swizzle does for ldmatrix);
// the Q tile keeps the swizzled layout. Rows that are not whole cached rows
// (keys past the split's end, appended keys) are written by the warp's lanes
// with ordinary loads and stores before the mbarrier arrive; columns past d
// are zeroed once at the start (the copies never touch them).
//
// Keys come from a contiguous cache (batch, len, heads_kv, d) or a paged one
// (pages, page_size, heads_kv, d) through block_table; keys at or past the
// cached length come from knew/vnew, which the CTA of m-block 0 whose split
// covers them also writes into the cache (nobody reads those cache rows in
// this launch: they are read from knew/vnew). Block-table entries live in a
// per-warp register window (64 entries, refilled 32 pages ahead with one
// coalesced load): a page lookup is a shuffle, never a load in front of a copy.
//
// Variants (VAR, decode_variant.cuh: compile-time switches, values in the parameter block): a window
// moves the splits' first key to the CTA's first visible one (so the kernel reads the window only) and
// masks each row's lower bound; softcap and ALiBi transform every block's scores before the mask; a
// sink joins the row's softmax in the one-split epilogue or in the merge of the splits. User mods
// (decode_mod.cuh) take the same interface: the score_mod as a transform, the mask_mod on every block.
//
// FP8 (an e4m3 cache, decode_fp8.cuh): the same loads on rows of d bytes -- half the bytes per key --
// into a ring of byte rows (swizzled as a 16-bit tile of D/2 columns). The main loop widens the K and V
// fragments to the query's dtype in registers between ldmatrix and mma: a plain ldmatrix of K gives a
// thread one key's columns 4t..4t+3, whose even and odd columns become the B fragment's two k-halves,
// so Q's A fragments are loaded with the same column order (q_frag8); the transposing ldmatrix of V
// gives columns 2g and 2g+1 of keys 2t, 2t+1, i.e. two n8 tiles (even and odd columns) whose outputs
// the epilogue puts back in column order. The K descale joins the softmax's scale (or the softcap's
// factor) and the V descale the output's normalisation: no fp32 work per element. Appended keys are
// quantized with the descales (x / descale, round to nearest, saturating) both into the cache and, for
// the blocks that read them, into the ring. The bulk loader does not take an FP8 cache.
//
// Output: with one split, the normalised O in the input dtype and the LSE.
// Otherwise the normalised fp32 O and the LSE of this split go into the
// workspace (an empty split writes O = 0, LSE = -inf); with p.counters set,
// the splits of each (batch, KV head, m-block) are merged in the kernel (no
// combine launch), else decode_combine does. In-kernel merge: two int counters
// per group (a ticket, a count of stored partials; zero between launches). A
// CTA takes its ticket as soon as its block loop ends; the one that draws the
// last ticket is the merger: it never stores its own partial, waits until the
// other splits have stored theirs (they all hold tickets, so they are running
// and wait on nobody: no deadlock), merges them with its own from shared
// memory and resets both counters.
#pragma once

typedef unsigned long long fg_u64;

// Timeline probe for study builds only: with FLASHGEN_PROBE defined (never in a shipped
// build), thread 0 of each CTA stamps %globaltimer (ns) at a few points into fg_probe; otherwise
// FG_PROBE expands to nothing and the kernel is unchanged.
#ifdef FLASHGEN_PROBE
#define FG_PROBE_SLOTS 8
#define FG_PROBE_CTAS 8192
__device__ unsigned long long fg_probe[FG_PROBE_CTAS * FG_PROBE_SLOTS];
#define FG_PROBE(slot)                                                                               \
  do {                                                                                               \
    if (threadIdx.x == 0) {                                                                          \
      unsigned long long t_;                                                                         \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                         \
      const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);          \
      if (cta_ < FG_PROBE_CTAS) fg_probe[cta_ * FG_PROBE_SLOTS + (slot)] = t_;                       \
    }                                                                                                \
  } while (0)
#else
#define FG_PROBE(slot) do {} while (0)
#endif


// 16-byte global->shared copy (src_bytes = 0: zeros, nothing read) in the
// flavour KV_LOAD selects (see the top of this file); `policy` is used by 2 and 3.
template <int KV_LOAD>
FG_DEVICE void kv_copy_16(fg_u32 dst, const void* src, int src_bytes, fg_u64 policy) {
  if constexpr (KV_LOAD == 0) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (KV_LOAD == 1) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else if constexpr (KV_LOAD == 2) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy));
  } else {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
                 "l"(src), "r"(src_bytes), "l"(policy));
  }
}

template <int KV_LOAD>
FG_DEVICE fg_u64 kv_policy() {
  fg_u64 pol = 0;
  if constexpr (KV_LOAD == 2 || KV_LOAD == 3 || KV_LOAD == 5)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}

// The bulk loader (KV_LOAD 4, 5: see the top of this file) and its padded ring rows.
template <int KV_LOAD>
__host__ __device__ constexpr bool kv_bulk() { return KV_LOAD >= 4; }
// Bytes of a K/V ring row: D elements of the cache (2 bytes, 1 for FP8), padded for the bulk loader.
template <int D, int KV_LOAD, bool FP8 = false>
__host__ __device__ constexpr int kv_row_bytes() { return (FP8 ? D : 2 * D) + (kv_bulk<KV_LOAD>() ? 16 : 0); }
// Dynamic shared memory: Q tile, K and V rings, and (bulk loader) 2 * ST * NW mbarriers.
// KernelSpec.smem_bytes() must agree (static_assert in the entry template).
template <int D, int BN, int NW, int ST, int KV_LOAD, bool FP8 = false>
__host__ __device__ constexpr int decode_smem_bytes() {
  return 16 * D * 2 + 2 * ST * BN * kv_row_bytes<D, KV_LOAD, FP8>() + (kv_bulk<KV_LOAD>() ? 2 * ST * NW * 8 : 0);
}

// The merge's handshake: a GPU-scope release increment (after a CTA barrier it publishes the stores
// of every thread of the CTA) and an acquire load (a CTA barrier after it passes the order on).
FG_DEVICE void red_release_add(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
FG_DEVICE int ld_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}


// Code: decode_split_cta holds one CTA's state (the launch geometry, the sequence's key range, the
// block-table window, this thread's load pointers: the constructor sets them up) and the stages of the
// kernel as member functions: append, load_q, the producer (fetch_pages, load_kv or bulk_rows,
// issue_block, prologue), the main loop (S = Q K^T, mask, softmax_step of softmax.cuh, O += P V) and
// the epilogue (the merge of the warps, then the stores or the in-kernel merge of the splits).
// decode_split_body runs them in order. Everything is inlined (FG_DEVICE), and where the state lives is
// chosen so that the compiler emits the machine code it did when this was one function. The stages that
// were the body's code take the parameters as an argument p (a reference parameter: the compiler may
// read it ahead of a branch), the helpers use the member p. The register
// state the main loop carries (O, the row max and sum, the pages of the next block) is its own locals,
// and the epilogue, which reads it, is called from there; the block-table window is the body's
// variables (as fields of the struct they would be ordered differently); an array member would keep the
// whole struct in memory until the loops are unrolled.
template <int D, int BN, int NW, int ST, bool FP8, bool BF16, int KV_LOAD, typename VAR, typename Params>
struct decode_split_cta {
  // (Enumerators, not static constexpr members: NVRTC emits such a member as a global object.)
  enum : int {
    NT = NW * 32,
    KW = BN / NW,     // keys per warp per block
    NJ = KW / 8,      // n8 tiles of S per warp
    DJ = D / 8,       // n8 tiles of O
    C = D / 8,        // 16-byte chunks per row of Q (and of k_new / v_new)
    KE = FP8 ? 16 : 8,  // K/V elements per 16-byte chunk of the cache and the ring
    KC = D / KE,      // 16-byte chunks per K/V row
    STEP = NT / KC,   // K/V rows one load pass covers
    IPG = 16 / STEP,  // load passes per 16-row group
    G = BN / 16,      // 16-row groups (page lookups) per block
    OS = D + 4,       // fp32 row stride of the reduction scratch (bank spread)
    BULK = kv_bulk<KV_LOAD>(),
    KV_ROW = kv_row_bytes<D, KV_LOAD, FP8>(),  // bytes per K/V ring row (padded for the bulk loader)
  };
  using TT = Tile<D>;           // the Q tile
  using KT = Tile<KE == 8 ? D : D / 2>;  // the K/V ring (cp.async loaders): rows of KV_ROW bytes
  typedef typename kv_elem<FP8>::type cache_t;
  static_assert(KW % 16 == 0 && NT % KC == 0 && 16 % STEP == 0 && BN % 16 == 0 && ST >= 2, "bad tile shape");
  static_assert(!(FP8 && BULK), "the bulk loader does not take an FP8 cache");
  static_assert(NW * 16 * OS * 4 + 16 * D * 4 <= 2 * ST * BN * KV_ROW,
                "reduction scratch and the merger's own partial must fit in the K/V ring");
  static_assert((2 * NW * 16 + 32) * 4 <= 16 * D * 2, "reduction scalars must fit in the Q tile");

  const Params& p;
  fg_u32 sQ, sK, sV, sBar;
  int warp, lane, g, t, split, mb, hk, b;
  int len_cache;
  bool has_new;
  int len, diag, r0, n_begin, split_end, n_end, n_blocks, fast_end;
  bool paged;
  int page_mask;
  const int* bt;
  int tab_len;
  int &wb, &win_lo, &win_hi;  // the block-table window (the body's variables; see the constructor)
  int tid, lc, lr;
  bool col_ok;
  int col_bytes;
  const cache_t *k_head, *v_head, *k_h, *v_h;
  const elem_t *kn_h, *vn_h, *kn_head, *vn_head;
  fg_u64 policy;
  int* pages;  // [G]: the pages of the 16-row groups of the next block to load (main_loop's array)
  int w_row;   // this warp's first key row within a block

  // ---- setup: shared memory, indices, the sequence's key range, the window, load pointers ----
  FG_DEVICE decode_split_cta(const Params& p, int& wb, int& win_lo, int& win_hi)
      : p(p), wb(wb), win_lo(win_lo), win_hi(win_hi) {
    extern __shared__ __align__(128) unsigned char smem[];
    sQ = smem_addr(smem);
    sK = sQ + 16 * D * 2;
    sV = sK + ST * BN * KV_ROW;
    // Bulk loader: the full barriers of (K or V, stage, warp), after the rings (never used as scratch).
    sBar = sV + ST * BN * KV_ROW;

    FG_PROBE(0);
#ifdef FLASHGEN_PROBE
    if (threadIdx.x == 0) {  // slot 7: the SM this CTA runs on
      unsigned smid_;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid_));
      const unsigned cta_ = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      if (cta_ < FG_PROBE_CTAS) fg_probe[cta_ * FG_PROBE_SLOTS + 7] = smid_;
    }
#endif
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    g = lane / 4, t = lane % 4;
    split = blockIdx.x % p.num_splits, mb = blockIdx.x / p.num_splits;
    hk = blockIdx.y, b = blockIdx.z;
    if constexpr (BULK) {
      // Each warp's own barriers, one arrival per phase (its lane 0's arrive.expect_tx).
      if (lane == 0) {
#pragma unroll
        for (int i = 0; i < 2 * ST; ++i) mbar_init(full_bar(i >= ST, i % ST), 1);
        mbar_init_fence();
        fence_proxy_async_smem();
      }
      __syncwarp();
    }

    len_cache = p.seqlens != nullptr ? p.seqlens[b] : p.seqlen_k;
    // Split 0 starts at key 0 whatever the sequence's length: while that length is loading (the load
    // above is in flight), warm L2 with the keys and values of its first ST - 1 blocks (contiguous cache;
    // rows past the length but within the capacity are valid memory, at most that many wasted 128-byte
    // lines). With a window the splits start where the window does, which the length decides: no warm-up.
    if (!VAR::WIN && p.seqlens != nullptr && p.block_table == nullptr && split == 0) {
      constexpr int LINES = (D * 16 / KE + 127) / 128;  // 128-byte lines per row (a row may start mid-line)
      const int rows = min(p.seqlen_k, (ST - 1) * BN);
      const fg_i64 row0 = static_cast<fg_i64>(b) * p.k_sb + hk * p.k_sh;
      const fg_i64 vrow0 = static_cast<fg_i64>(b) * p.v_sb + hk * p.v_sh;
      for (int i = threadIdx.x; i < rows * LINES; i += NW * 32) {
        const int row = i / LINES, c = (i % LINES) * (8 * KE);  // elements per 128 bytes
        if (c >= p.d) continue;  // (d < D: never an address past the row, so never past the cache)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.k + row0 + row * p.k_ss + c));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.v + vrow0 + row * p.v_ss + c));
      }
    }
    has_new = p.knew != nullptr;
    len = len_cache + (has_new ? p.nq : 0);  // keys of this sequence after the append
    diag = len - p.nq;                        // new token i sees keys j <= i + diag
    r0 = mb * 16;
    const int last_row = min(r0 + 15, p.rows - 1);
    const int kv_end = max(0, min(len, last_row / p.group + diag + 1));  // no row of the tile sees past this
    // The splits cover [kv_begin, len): 0 without a window, else the block of the CTA's first visible key.
    const int kv_begin = VAR::template first_key<BN>(p, r0, diag);
    const int blocks = ceil_div(len - kv_begin, BN);
    const int bps = ceil_div(blocks, p.num_splits);
    n_begin = kv_begin + split * bps * BN;
    split_end = min(len, kv_begin + (split + 1) * bps * BN);
    n_end = min(kv_end, split_end);
    n_blocks = n_end > n_begin ? ceil_div(n_end - n_begin, BN) : 0;
    fast_end = min(n_end, len_cache);  // a block ending at or before this is whole and cached
    FG_PROBE(1);  // (the seqlens load has returned)

    paged = p.block_table != nullptr;
    page_mask = (1 << p.page_shift) - 1;
    bt = p.block_table + (paged ? b * p.bt_sb : 0);
    // Block-table window: each warp holds 64 entries of its sequence's row in two registers (lane i:
    // entries wb + i and wb + 32 + i), loaded with one coalesced 128-byte load per 32 pages, 32 pages
    // before they are needed; a page lookup is then a shuffle, never a load in front of a copy. The
    // first two loads go out here, before the Q gather and the append, to overlap their latency.
    tab_len = paged ? (p.seqlen_k >> p.page_shift) : 0;  // entries in a row (capacity / page)
    wb = paged ? (n_begin >> p.page_shift) : 0;
    win_lo = 0, win_hi = 0;
    if (paged) {
      if (wb + lane < tab_len) win_lo = __ldg(bt + wb + lane);
      if (wb + 32 + lane < tab_len) win_hi = __ldg(bt + wb + 32 + lane);
    }
    // Element offsets of (batch or page, seq) are added per row group; heads and chunk columns once.
    tid = threadIdx.x;
    lc = tid % KC, lr = tid / KC;
    col_ok = lc * KE < p.d;
    // (FP8: a chunk of 16 columns may hold only 8 of d, a multiple of 8; the copy zero-fills the rest.)
    col_bytes = FP8 ? max(0, min(16, p.d - lc * KE)) : (col_ok ? 16 : 0);
    k_head = p.k + hk * p.k_sh;
    v_head = p.v + hk * p.v_sh;
    k_h = k_head + lc * KE;
    v_h = v_head + lc * KE;
    kn_h = p.knew + (has_new ? b * p.knew_sb + hk * p.knew_sh + lc * KE : 0);
    vn_h = p.vnew + (has_new ? b * p.vnew_sb + hk * p.vnew_sh + lc * KE : 0);
    // (batch, head) bases of knew/vnew without this thread's column (the bulk loader's appended rows).
    kn_head = p.knew + (has_new ? b * p.knew_sb + hk * p.knew_sh : 0);
    vn_head = p.vnew + (has_new ? b * p.vnew_sb + hk * p.vnew_sh : 0);
    policy = kv_policy<KV_LOAD>();
  }

  FG_DEVICE fg_u32 full_bar(bool V, int stage) const { return sBar + ((V * ST + stage) * NW + warp) * 8; }

  // An FP8 cache's descale factor of this CTA's (batch, KV head): K's or V's.
  FG_DEVICE float descale(bool V) const {
    return V ? __ldg(p.vd + static_cast<fg_i64>(b) * p.vd_sb + hk * p.vd_sh)
             : __ldg(p.kd + static_cast<fg_i64>(b) * p.kd_sb + hk * p.kd_sh);
  }

  // The K descale folded into the scores' scale (FP8 without a softcap) or into the softcap's factor
  // before the tanh (with one: the scale then holds the cap, decode_variant.cuh); else as given.
  FG_DEVICE static float scores_scale(float scale, float kd) { return FP8 && !VAR::CAP ? scale * kd : scale; }
  FG_DEVICE static float cap_factor(float cap_in, float kd) { return FP8 && VAR::CAP ? cap_in * kd : cap_in; }

  // FP8: Q's A fragment of k-step kk in the column order of a widened K register (e4m3x4_widen of one
  // key's columns 4t..4t+3): columns (4t, 4t+2) where the 16-bit layout has (2t, 2t+1), (4t+1, 4t+3) for
  // (2t+8, 2t+9), of rows g and g + 8 (8 bytes each from the swizzled Q tile; `cols` = Cols(g, t >> 1)).
  FG_DEVICE void q_frag8(fg_u32 (&a)[4], fg_u32 q_g, const typename TT::Cols& cols, int kk) const {
    const fg_u32 at = q_g + cols.col(kk) + 8 * (t & 1);
    fg_u32 x0, x1, y0, y1;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(x0), "=r"(x1) : "r"(at));
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(y0), "=r"(y1) : "r"(at + 8 * TT::ROW_BYTES));
    a[0] = byte_perm(x0, x1, 0x5410u);
    a[1] = byte_perm(y0, y1, 0x5410u);
    a[2] = byte_perm(x0, x1, 0x7632u);
    a[3] = byte_perm(y0, y1, 0x7632u);
  }

  // ---- append: m-block 0 copies the new rows its split covers into the cache (FP8: quantized) ----
  FG_DEVICE void append(const Params& p) {
    if (has_new && mb == 0) {
      float kd = 1.f, vd = 1.f;
      if constexpr (FP8) kd = descale(false), vd = descale(true);
      const int a0 = max(n_begin, len_cache), a1 = split_end;
      for (int i = tid; i < (a1 - a0) * C; i += NT) {
        const int key = a0 + i / C, c = i % C;
        if (c * 8 >= p.d) continue;
        fg_i64 ko, vo;
        if (paged) {
          const fg_i64 pg = bt[key >> p.page_shift];
          ko = pg * p.k_sb + (key & page_mask) * p.k_ss;
          vo = pg * p.v_sb + (key & page_mask) * p.v_ss;
        } else {
          ko = b * p.k_sb + static_cast<fg_i64>(key) * p.k_ss;
          vo = b * p.v_sb + static_cast<fg_i64>(key) * p.v_ss;
        }
        const int rn = key - len_cache;
        const fg_i64 co = c * 8 - lc * KE;  // the *_h pointers carry this thread's own column
        const fg_u32x4* const ksrc = reinterpret_cast<const fg_u32x4*>(kn_h + co + rn * p.knew_ss);
        const fg_u32x4* const vsrc = reinterpret_cast<const fg_u32x4*>(vn_h + co + rn * p.vnew_ss);
        cache_t* const kdst = const_cast<cache_t*>(k_h) + co + ko;
        cache_t* const vdst = const_cast<cache_t*>(v_h) + co + vo;
        if constexpr (FP8) {
          *reinterpret_cast<uint2*>(kdst) = e4m3x8_quantize<BF16>(*ksrc, kd);
          *reinterpret_cast<uint2*>(vdst) = e4m3x8_quantize<BF16>(*vsrc, vd);
        } else {
          *reinterpret_cast<fg_u32x4*>(kdst) = *ksrc;
          *reinterpret_cast<fg_u32x4*>(vdst) = *vsrc;
        }
      }
    }
  }

  // ---- Q: 16 packed rows gathered from (token, head) ----------------------------
  FG_DEVICE void load_q(const Params& p) {
    const elem_t* q_b = p.q + b * p.q_sb;
#pragma unroll
    for (int it = 0; it < (16 * C + NT - 1) / NT; ++it) {
      const int i = it * NT + tid;
      if ((16 * C) % NT != 0 && i >= 16 * C) break;
      const int row = i / C, c = i % C;
      const int r = r0 + row;
      const bool ok = r < p.rows && c * 8 < p.d;
      const int tok = r / p.group, hh = r - tok * p.group;
      const elem_t* src = ok ? q_b + tok * p.q_ss + (hk * p.group + hh) * p.q_sh + c * 8 : p.q;
      cp_async_16(sQ + TT::offset(row, c), src, ok ? 16 : 0);
    }
    cp_async_commit();
  }

  // ---- producer: pages, K/V loads into the ring ----------------------------------
  // Pages of the 16-row groups of the block starting at key n0 (0 where unused), from the window.
  // Called for consecutive blocks (n0 = n_begin, n_begin + BN, ...) by every thread: a block spans at
  // most BN/16 <= 8 pages, so one 32-entry step of the window per call keeps every index below 64.
  FG_DEVICE void step_window(int n0) {
    if (paged && (n0 >> p.page_shift) - wb >= 32) {  // the upper half was loaded 32 pages ago
      wb += 32;
      win_lo = win_hi;
      win_hi = wb + 32 + lane < tab_len ? __ldg(bt + wb + 32 + lane) : 0;
    }
  }
  // The page of `key` (a key of the block the window was last stepped for), by every lane of the warp
  // (a shuffle; lanes may ask for different keys).
  FG_DEVICE int page_of(int key) const {
    const int idx = (key >> p.page_shift) - wb;  // 0..63 for a key of the current block
    const int lo = __shfl_sync(0xffffffffu, win_lo, idx & 31);
    const int hi = __shfl_sync(0xffffffffu, win_hi, idx & 31);
    return idx < 32 ? lo : hi;
  }
  FG_DEVICE void fetch_pages(int n0) {
    if (!paged) {
#pragma unroll
      for (int e = 0; e < G; ++e) pages[e] = 0;
      return;
    }
    step_window(n0);
    if constexpr (!BULK) {  // (the bulk loader looks its pages up per row)
#pragma unroll
      for (int e = 0; e < G; ++e) {
        const int key0 = n0 + e * 16;
        const int pg = page_of(key0);  // the same key in every lane
        pages[e] = (key0 < n_end && key0 < len_cache) ? pg : 0;
      }
    }
  }
  // K or V of the block at key n0 into ring stage `stage` (every call passes a constant V, and the
  // function is inlined, so the branches fold away).
  FG_DEVICE void load_kv(int n0, int stage, bool V) {  // V: false loads K, true loads V
    const cache_t* const head = V ? v_h : k_h;
    const fg_i64 sb = V ? p.v_sb : p.k_sb, ss = V ? p.v_ss : p.k_ss;
    const fg_u32 dst = (V ? sV : sK) + stage * BN * KV_ROW;
    if (n0 + BN <= fast_end && !paged) {
      // Fast path, contiguous cache: the block's rows are one run of BN rows, so one pointer walks them
      // (one 64-bit multiply per block, then an add per copy; the shared-memory offsets are constants).
      const cache_t* src = head + static_cast<fg_i64>(b) * sb + static_cast<fg_i64>(n0 + lr) * ss;
      const fg_i64 step = STEP * ss;
#pragma unroll
      for (int r = 0; r < BN; r += STEP) {
        kv_copy_16<KV_LOAD>(dst + KT::offset(r + lr, lc), src, col_bytes, policy);
        src += step;
      }
    } else if (n0 + BN <= fast_end) {
      // Fast path, paged cache: whole block in the cache. 16-row groups never straddle a page.
#pragma unroll
      for (int e = 0; e < G; ++e) {
        const int key0 = n0 + e * 16;
        const cache_t* src = head + static_cast<fg_i64>(pages[e]) * sb + ((key0 & page_mask) + lr) * ss;
#pragma unroll
        for (int i = 0; i < IPG; ++i) {
          kv_copy_16<KV_LOAD>(dst + KT::offset(e * 16 + lr + i * STEP, lc), src, col_bytes, policy);
          src += STEP * ss;
        }
      }
    } else {
      // Checked path: rows past n_end are zero-filled without reading; appended keys come from knew/vnew.
      const elem_t* const nhead = V ? vn_h : kn_h;
      const fg_i64 nss = V ? p.vnew_ss : p.knew_ss;
#pragma unroll
      for (int it = 0; it < BN / STEP; ++it) {
        const int row = lr + it * STEP;
        const int key = n0 + row;
        const bool ok = col_ok && key < n_end;
        const void* src = V ? p.v : p.k;
        if (ok) {
          if (key >= len_cache) {
            if constexpr (FP8) continue;  // quantized below
            src = nhead + static_cast<fg_i64>(key - len_cache) * nss;
          } else if (paged) {
            src = head + static_cast<fg_i64>(pages[it * STEP / 16]) * sb + (key & page_mask) * ss;
          } else {
            src = head + static_cast<fg_i64>(b) * sb + static_cast<fg_i64>(key) * ss;
          }
        }
        kv_copy_16<KV_LOAD>(dst + KT::offset(row, lc), src, ok ? (FP8 ? col_bytes : 16) : 0, policy);
      }
      if constexpr (FP8) {
        // FP8: the appended keys' rows, quantized with the descale as the append stores them into the
        // cache (a rolled loop: the exact division's code once per copy of this function).
        if (col_ok && n0 + BN > len_cache) {
#pragma unroll 1
          for (int it = 0; it < BN / STEP; ++it) {
            const int row = lr + it * STEP;
            const int key = n0 + row;
            if (key >= len_cache && key < n_end)
              store_new8(dst + KT::offset(row, lc), nhead + static_cast<fg_i64>(key - len_cache) * nss, V);
          }
        }
      }
    }
  }
  // FP8, checked path: this thread's chunk (16 columns, col_bytes of them within d) of an appended key's
  // row of k_new / v_new at `fresh`, quantized with the descale, into the ring at `dst`.
  FG_DEVICE void store_new8(fg_u32 dst, const elem_t* fresh, bool V) const {
    const float ds = descale(V);
    fg_u32x4 upper = {0u, 0u, 0u, 0u};  // columns 8..15 of the chunk, where they are within d
    if (col_bytes == 16) upper = *reinterpret_cast<const fg_u32x4*>(fresh + 8);
    const uint2 lo = e4m3x8_quantize<BF16>(*reinterpret_cast<const fg_u32x4*>(fresh), ds);
    const uint2 hi = e4m3x8_quantize<BF16>(upper, ds);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(lo.x), "r"(lo.y), "r"(hi.x), "r"(hi.y)
                 : "memory");
  }
  // Bulk loader: this warp's KW rows of K and of V of the block at key n0 into `stage`. Whole cached
  // rows: one cp.async.bulk each (lane i: copy i, K rows then V rows); other rows (past n_end: zeros;
  // appended keys: from knew/vnew) are stored by the lanes first, then lane 0 arrives on the stage's K
  // and V barriers expecting the bulk bytes, then the copies go out.
  FG_DEVICE void bulk_rows(int n0, int stage) {
    constexpr int COPIES = 2 * KW;
    const int key_w = n0 + w_row;
    const int n_bulk = max(0, min(KW, min(n_end, len_cache) - key_w));  // rows [0, n_bulk) are whole cached rows
    const fg_u32 row_bytes = static_cast<fg_u32>(p.d) * 2;
    const fg_u32 dst_k = sK + (stage * BN + w_row) * KV_ROW, dst_v = sV + (stage * BN + w_row) * KV_ROW;
    if (n_bulk < KW) {
      for (int i = lane; i < COPIES * C; i += 32) {
        const bool V = i >= KW * C;
        const int row = (i / C) % KW, c = i % C;
        const int key = key_w + row;
        if (row < n_bulk || c * 8 >= p.d) continue;  // bulk rows; columns past d are already zero
        fg_u32x4 val = {0u, 0u, 0u, 0u};
        if (key < n_end) {  // an appended key (the cached ones are bulk rows)
          const elem_t* src = (V ? vn_head : kn_head) + static_cast<fg_i64>(key - len_cache) *
                              (V ? p.vnew_ss : p.knew_ss) + c * 8;
          val = *reinterpret_cast<const fg_u32x4*>(src);
        }
        const fg_u32 dst = (V ? dst_v : dst_k) + row * KV_ROW + c * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(val.x), "r"(val.y), "r"(val.z),
                     "r"(val.w) : "memory");
      }
      fence_proxy_async_smem();
      __syncwarp();
    }
    if (lane == 0) {  // this warp's one arrival per phase, with the bytes its copies will bring
      mbar_expect_tx(full_bar(false, stage), n_bulk * row_bytes);
      mbar_expect_tx(full_bar(true, stage), n_bulk * row_bytes);
    }
    __syncwarp();
#pragma unroll
    for (int it = 0; it < (COPIES + 31) / 32; ++it) {
      const int cp = it * 32 + lane;
      const bool V = cp >= KW;
      const int row = V ? cp - KW : cp;
      const int key = key_w + row;
      const int pg = paged ? page_of(key) : 0;  // every lane takes part in the shuffles
      if ((COPIES % 32 == 0 || cp < COPIES) && row < n_bulk) {
        const fg_i64 off = paged ? static_cast<fg_i64>(pg) * (V ? p.v_sb : p.k_sb) + (key & page_mask) * (V ? p.v_ss : p.k_ss)
                                 : static_cast<fg_i64>(b) * (V ? p.v_sb : p.k_sb) + static_cast<fg_i64>(key) * (V ? p.v_ss : p.k_ss);
        const fg_u32 dst = (V ? dst_v : dst_k) + row * KV_ROW;
        const fg_u32 bar = full_bar(V, stage);
        if constexpr (KV_LOAD == 5) {
          bulk_g2s_hint(dst, (V ? v_head : k_head) + off, row_bytes, bar, policy);
        } else {
          bulk_g2s(dst, (V ? v_head : k_head) + off, row_bytes, bar);
        }
      }
    }
  }
  // Both halves of block jb into its stage: two commit groups (K, then V); past the end, two empty ones.
  // Bulk loader: this warp's rows of block jb (nothing past the end).
  FG_DEVICE void issue_block(int jb) {
    if constexpr (BULK) {
      if (jb < n_blocks) {
        bulk_rows(n_begin + jb * BN, jb % ST);
        fetch_pages(n_begin + (jb + 1) * BN);
      }
    } else {
      if (jb < n_blocks) {
        load_kv(n_begin + jb * BN, jb % ST, false);
        cp_async_commit();
        load_kv(n_begin + jb * BN, jb % ST, true);
        cp_async_commit();
        fetch_pages(n_begin + (jb + 1) * BN);
      } else {
        cp_async_commit();
        cp_async_commit();
      }
    }
  }
  // The first ST - 1 blocks (and, bulk loader, the zeroed pad columns), before the block loop.
  FG_DEVICE void prologue(const Params& p) {
    w_row = warp * KW;
    if constexpr (BULK) {
      // Columns [d, D) of every ring row: zero once (the copies bring d columns; K's must not be NaN).
      if (p.d < D) {
        for (int i = tid; i < 2 * ST * BN * C; i += NT) {
          const int row = i / C, c = i % C;
          if (c * 8 < p.d) continue;
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sK + row * KV_ROW + c * 16), "r"(0u) : "memory");
        }
      }
    }
    fetch_pages(n_begin);
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) issue_block(s);
    if constexpr (BULK) {
      cp_async_wait<0>();
      __syncthreads();  // Q (and the zeroed columns) visible to every warp; no CTA barrier in the block loop
    }
  }

  // ---- the main loop: per K/V block S = Q K^T, mask, online softmax, O += P V (per warp) ----
  // The prologue's loads first, the epilogue at the end (see the top of the struct: the loop's register
  // state is this function's).
  FG_DEVICE void main_loop(const Params& p) {
    int pages_[G];
    pages = pages_;
    prologue(p);

    float acc_o[DJ][4];
#pragma unroll
    for (int dj = 0; dj < DJ; ++dj)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[dj][e] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

    // Per-row key limits (exclusive) of this thread's rows g and g+8; padded rows
    // (r >= rows) get a limit too, their results are never stored.
    int row_lim[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) row_lim[h] = min(n_end, (r0 + g + 8 * h) / p.group + diag + 1);
    const int mask_from = min(n_end, r0 / p.group + diag + 1);  // the tile's smallest limit
    // FP8: the scores are q . k8 (k = k8 kd), so the K descale joins the softmax's scale (or the softcap's
    // factor before the tanh); the 16-bit kernel reads both from the parameters as before.
    const float kd = FP8 ? descale(false) : 1.f;
    VAR var;  // the variant's per-row values (decode_variant.cuh; nothing for plain decode)
    var.set_rows(p, b, hk, r0, g, diag, scores_scale(p.scale_log2, kd));

    const int q_row = lane & 15;
    const int k_row = ((lane >> 4) << 3) + (lane & 7);
    const typename TT::Cols q_cols(q_row, lane >> 4);
    const typename KT::Cols k_cols(k_row, (lane >> 3) & 1);
    const typename KT::Cols v_cols(q_row, lane >> 4);  // (FP8; the 16-bit ring's V lanes are Q's, q_cols)
    const typename TT::Cols g_cols(g, t >> 1);         // (FP8: Q's fragments by rows g, g + 8: q_frag8)
    const fg_u32 q_base = sQ + q_row * TT::ROW_BYTES;
    const fg_u32 q_g = sQ + g * TT::ROW_BYTES;
    // Lane offsets into a warp's K / V slice of a stage for ldmatrix: swizzled rows (TT) for cp.async,
    // padded plain rows for the bulk loader (logical chunk c at byte 16 c).
    const fg_u32 k_lane = k_row * KV_ROW + (BULK ? 16 * ((lane >> 3) & 1) : 0);
    const fg_u32 v_lane = q_row * KV_ROW + (BULK ? 16 * (lane >> 4) : 0);
    auto k_addr = [&](fg_u32 base, int nj2, int kk) -> fg_u32 {
      if constexpr (BULK) return base + k_lane + nj2 * 16 * KV_ROW + kk * 32;
      return base + (nj2 * 16 + k_row) * KT::ROW_BYTES + k_cols.col(kk);  // (FP8: kk a pair of k-steps)
    };
    auto v_addr = [&](fg_u32 base, int kk, int dj2) -> fg_u32 {
      if constexpr (BULK) return base + v_lane + kk * 16 * KV_ROW + dj2 * 32;
      return base + (kk * 16 + q_row) * TT::ROW_BYTES + q_cols.col(dj2);
    };

    // Q's A fragments stay in registers for the whole block loop (D = 128: 32 registers), instead of D / 16
    // ldmatrix of the Q tile per block: Q's copy group is the oldest, so waiting for all but the prologue's
    // K/V groups (then a CTA barrier) is enough. Measured at D = 128 only (docs/perf/decode.md); the
    // other tiles keep their registers (the H200's NVRTC 13.0 once spilled the d = 32 tile with it).
    constexpr bool QREG = D == 128;
    fg_u32 qf[QREG ? D / 16 : 1][4];
    // A split with no block reads nothing: its Q copy may still be in flight (the epilogue waits for it).
    if constexpr (QREG) {
      if (n_blocks > 0) {
        if constexpr (!BULK) {
          cp_async_wait<2 * (ST - 1)>();
          __syncthreads();
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          if constexpr (FP8) {
            q_frag8(qf[kk], q_g, g_cols, kk);
          } else {
            ldmatrix_x4(qf[kk], q_base + q_cols.col(kk));
          }
        }
      }
    }

    for (int j = 0; j < n_blocks; ++j) {
      const int stage = j % ST;
      if constexpr (BULK) {
        issue_block(j + ST - 1);  // into stage (j-1) % ST: this warp finished its rows of block j-1 there
        mbar_wait(full_bar(false, stage), (j / ST) & 1);
      } else {
        // Groups newer than K_j: V_j and both halves of blocks j+1 .. j+ST-2.
        cp_async_wait<2 * ST - 3>();
        __syncthreads();  // K_j visible to all; every warp is done with block j-1, whose stage is refilled next
        issue_block(j + ST - 1);
      }
#ifdef FLASHGEN_PROBE
      if (j == 0) FG_PROBE(2);  // the first K block has landed
#endif
      const fg_u32 sKj = sK + stage * BN * KV_ROW + w_row * KV_ROW;
      const fg_u32 sVj = sV + stage * BN * KV_ROW + w_row * KV_ROW;

      // ---- S = Q K^T over this warp's KW keys ----
      float acc_s[NJ][4];
#pragma unroll
      for (int nj = 0; nj < NJ; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[nj][e] = 0.f;
      if constexpr (FP8) {
        // Per pair of k-steps (32 columns, two 16-byte chunks) and 16 keys one ldmatrix.x4: register m
        // holds key 8 (m >> 1) + g's columns 4t..4t+3 of k-step 2 kp + (m & 1), widened to its B fragment.
#pragma unroll
        for (int kp = 0; kp < D / 32; ++kp) {
          fg_u32 a_ld[2][4];
          if constexpr (!QREG) {
            q_frag8(a_ld[0], q_g, g_cols, 2 * kp);
            q_frag8(a_ld[1], q_g, g_cols, 2 * kp + 1);
          }
#pragma unroll
          for (int nj2 = 0; nj2 < NJ / 2; ++nj2) {
            fg_u32 kfrag[4];
            ldmatrix_x4(kfrag, k_addr(sKj, nj2, kp));
#pragma unroll
            for (int m = 0; m < 4; ++m) {
              fg_u32 b0, b1;
              e4m3x4_widen<BF16>(kfrag[m], b0, b1);
              const fg_u32(&a)[4] = QREG ? qf[2 * kp + (m & 1)] : a_ld[m & 1];
              mma_16816<BF16>(acc_s[2 * nj2 + (m >> 1)], a, b0, b1);
            }
          }
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          fg_u32 a_ld[4];
          if constexpr (!QREG) ldmatrix_x4(a_ld, q_base + q_cols.col(kk));
          const fg_u32(&a)[4] = QREG ? qf[kk] : a_ld;
#pragma unroll
          for (int nj2 = 0; nj2 < NJ / 2; ++nj2) {
            fg_u32 bfrag[4];
            ldmatrix_x4(bfrag, k_addr(sKj, nj2, kk));
            mma_16816<BF16>(acc_s[2 * nj2], a, bfrag[0], bfrag[1]);
            mma_16816<BF16>(acc_s[2 * nj2 + 1], a, bfrag[2], bfrag[3]);
          }
        }
      }

      // ---- the variant's score transforms (softcap, ALiBi), on every block ----
      const int n0 = n_begin + j * BN;
      if constexpr (VAR::TRANSFORMS) {
#pragma unroll
        for (int h = 0; h < 2; ++h) var.transform(p, acc_s, h, r0 + g + 8 * h, diag, n0 + w_row + 2 * t,
                                                    cap_factor(p.cap_in, kd));
      }

      // ---- mask: the split end, the sequence end, the causal diagonal (and the window's start) ----
      // A window masks every block: the test for the blocks its start crosses (a register across the
      // loop) made the n64 tile spill, and the mask is a few selects per score of a memory-bound loop.
      if (VAR::MASK_ALL || n0 + BN > mask_from) {
#pragma unroll
        for (int h = 0; h < 2; ++h) var.mask(p, acc_s, h, r0 + g + 8 * h, diag, n0 + w_row + 2 * t, row_lim[h]);
      }

      // ---- online softmax (per warp) ----
#pragma unroll
      for (int h = 0; h < 2; ++h) softmax_step(acc_s, acc_o, h, row_max[h], row_sum[h], scores_scale(p.scale_log2, kd));

      if constexpr (BULK) {
        mbar_wait(full_bar(true, stage), (j / ST) & 1);
      } else {
        // Groups newer than V_j: both halves of blocks j+1 .. j+ST-1.
        cp_async_wait<2 * ST - 2>();
        __syncthreads();  // V_j visible to all
      }

      // ---- O += P V ----
#pragma unroll
      for (int kk = 0; kk < KW / 16; ++kk) {
        fg_u32 a[4];
        p_frag<BF16>(a, acc_s, kk);
        if constexpr (FP8) {
          // Per two 16-byte chunks (32 columns) one transposing ldmatrix.x4: registers 2c and 2c + 1 hold
          // keys 2t, 2t + 1 and 8 + 2t, 9 + 2t of columns 2g, 2g + 1 of chunk 2 dq + c, widened into the B
          // fragments of its even-column and odd-column n8 tiles (acc_o[2 chunk], acc_o[2 chunk + 1]).
#pragma unroll
          for (int dq = 0; dq < D / 32; ++dq) {
            fg_u32 vfrag[4];
            ldmatrix_x4_trans(vfrag, sVj + (kk * 16 + q_row) * KT::ROW_BYTES + v_cols.col(dq));
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              fg_u32 e0, o0, e1, o1;
              e4m3x4_widen<BF16>(vfrag[2 * c], e0, o0);
              e4m3x4_widen<BF16>(vfrag[2 * c + 1], e1, o1);
              mma_16816<BF16>(acc_o[4 * dq + 2 * c], a, e0, e1);
              mma_16816<BF16>(acc_o[4 * dq + 2 * c + 1], a, o0, o1);
            }
          }
        } else {
#pragma unroll
          for (int dj2 = 0; dj2 < DJ / 2; ++dj2) {
            fg_u32 bfrag[4];
            ldmatrix_x4_trans(bfrag, v_addr(sVj, kk, dj2));
            mma_16816<BF16>(acc_o[2 * dj2], a, bfrag[0], bfrag[1]);
            mma_16816<BF16>(acc_o[2 * dj2 + 1], a, bfrag[2], bfrag[3]);
          }
        }
      }
    }
    epilogue(p, acc_o, row_max, row_sum);
  }

  // Final stores of one packed row: O (4 columns from c4*4) in the input dtype, and its LSE.
  FG_DEVICE void store_o(int r, int c4, float4 acc) const {
    const int tok = r / p.group, h = hk * p.group + (r - tok * p.group);
    uint2 packed;
    packed.x = pack2<BF16>(acc.x, acc.y);
    packed.y = pack2<BF16>(acc.z, acc.w);
    *reinterpret_cast<uint2*>(p.o + b * p.o_sb + tok * p.o_ss + h * p.o_sh + c4 * 4) = packed;
  }
  FG_DEVICE void store_lse(int r, float lse) const {
    const int tok = r / p.group, h = hk * p.group + (r - tok * p.group);
    if (p.lse != nullptr) p.lse[(static_cast<fg_i64>(b) * p.heads_q + h) * p.nq + tok] = lse;
  }
  // Workspace row of packed row r: (batch, token, query head).
  FG_DEVICE fg_i64 ws_row(int r) const {
    const int tok = r / p.group, h = hk * p.group + (r - tok * p.group);
    return (static_cast<fg_i64>(b) * p.nq + tok) * p.heads_q + h;
  }
  // ---- epilogue: merge the warps, then store (one split: the final O and LSE; else this split's
  // partial into the workspace), or, in the CTA that drew its group's last ticket, merge the splits ----
  FG_DEVICE void epilogue(const Params& p, const float (&acc_o)[DJ][4], const float (&row_max)[2],
                          const float (&row_sum)[2]) {
    extern __shared__ __align__(128) unsigned char smem[];
    // In-kernel merge (see the top of this file): the ticket goes out now, its answer is used after the
    // warp merge below (the round trip overlaps it).
    const bool direct = p.num_splits == 1;
    const bool fused = !direct && p.counters != nullptr;
    int* const ctr = p.counters + 2 * ((static_cast<fg_i64>(b) * gridDim.y + hk) * (gridDim.x / p.num_splits) + mb);
    int ticket = 0;
    if (fused && tid == 0) ticket = atomicAdd(ctr, 1);
    // Sinks: this thread's two rows' (used where one split covers the rows; loaded before the barriers).
    float sink_row[2] = {0.f, 0.f};
    if constexpr (VAR::SINK) {
      if (direct) {
#pragma unroll
        for (int h = 0; h < 2; ++h) sink_row[h] = p.sinks[VAR::head_of(p, hk, r0 + g + 8 * h)];
      }
    }
    // FP8: the scores' scales take the K descale (as in main_loop), and the V descale scales this CTA's O.
    float kd = 1.f, vd = 1.f;
    if constexpr (FP8) kd = descale(false), vd = descale(true);
    const auto scale = [&] { return scores_scale(p.scale, kd); };
    const auto scale_log2 = [&] { return scores_scale(p.scale_log2, kd); };
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring (and the Q copies have landed)
    FG_PROBE(3);

    // ---- merge the warps: per row max, sum; each warp's O scaled into scratch ----
    // red: [NW][16] max, [NW][16] sum, [16] lse of this split, [1] merger flag
    float* red = reinterpret_cast<float*>(smem);
    float* s_o = reinterpret_cast<float*>(smem + 16 * D * 2);   // [NW][16][OS]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(row_sum[h]);
      if (t == 0) {
        red[warp * 16 + g + 8 * h] = row_max[h];
        red[NW * 16 + warp * 16 + g + 8 * h] = l;
      }
    }
    __syncthreads();
    // (Each warp's partial weighs exp2((m_w - m_all) scale_log2): a merge, not softmax.cuh's online step.)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = g + 8 * h;
      float m_all = -INFINITY;
#pragma unroll
      for (int w = 0; w < NW; ++w) m_all = fmaxf(m_all, red[w * 16 + row]);
      float l_all = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float mw = red[w * 16 + row];
        if (mw != -INFINITY) l_all += red[NW * 16 + w * 16 + row] * fast_exp2((mw - m_all) * scale_log2());
      }
      const float own = row_max[h] == -INFINITY ? 0.f : fast_exp2((row_max[h] - m_all) * scale_log2());
      float f = l_all > 0.f ? own / l_all : 0.f;
      float sink_lse = 0.f;
      if constexpr (VAR::SINK) {  // one split covers the row: its sink joins here (else in the merge)
        if (direct) VAR::finish_sink(m_all, l_all, scale(), sink_row[h], own, f, sink_lse);
      }
      if constexpr (FP8) {
        // acc_o[2c] and acc_o[2c + 1] hold chunk c's even and odd columns (main_loop): this thread's
        // 16c + 4t .. + 3 are (even[2h], odd[2h], even[2h + 1], odd[2h + 1]).
        f *= vd;
        float* dst = s_o + (warp * 16 + row) * OS + 4 * t;
#pragma unroll
        for (int c = 0; c < D / 16; ++c) {
          const float(&even)[4] = acc_o[2 * c];
          const float(&odd)[4] = acc_o[2 * c + 1];
          *reinterpret_cast<float4*>(dst + 16 * c) =
              make_float4(even[2 * h] * f, odd[2 * h] * f, even[2 * h + 1] * f, odd[2 * h + 1] * f);
        }
      } else {
        float* dst = s_o + (warp * 16 + row) * OS + 2 * t;
#pragma unroll
        for (int dj = 0; dj < DJ; ++dj) {
          dst[dj * 8] = acc_o[dj][2 * h] * f;
          dst[dj * 8 + 1] = acc_o[dj][2 * h + 1] * f;
        }
      }
      if (warp == 0 && t == 0) red[2 * NW * 16 + row] = VAR::SINK && direct ? sink_lse : row_lse(m_all, l_all, scale());
    }
    // red[2 * NW * 16 + 16]: this CTA merges (it drew the last ticket of its group). Then thread 0 of the
    // merger waits for the other splits' partials here, so the round trip overlaps the warp merge.
    if (tid == 0) {
      const bool last = fused && ticket == p.num_splits - 1;
      reinterpret_cast<int*>(red)[2 * NW * 16 + 16] = last;
      if (last) {
        while (ld_acquire(ctr + 1) != p.num_splits - 1) __nanosleep(32);
        ctr[0] = 0;  // both counters ready for the next launch (launches on one stream never overlap):
        ctr[1] = 0;  // every other CTA of the group has taken its ticket and made its last increment
      }
    }
    __syncthreads();  // (and the merger's acquire, passed on to every thread)
    const bool merger = reinterpret_cast<const int*>(red)[2 * NW * 16 + 16] != 0;
    // The sum over the warps of this CTA's (scaled) O, 4 columns of packed row `row`.
    auto own_o = [&](int row, int c4) -> float4 {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(s_o + (w * 16 + row) * OS + c4 * 4);
        acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
      }
      return acc;
    };

    // ---- store: 16 rows x D/4 float4 columns, summed over the warps ----
    if (!merger) {
      for (int i = tid; i < 16 * (D / 4); i += NT) {
        const int row = i / (D / 4), c4 = i % (D / 4);
        const int r = r0 + row;
        if (r >= p.rows || c4 * 4 >= p.d) continue;
        const float4 acc = own_o(row, c4);
        if (direct) {
          store_o(r, c4, acc);
        } else {
          *reinterpret_cast<float4*>(p.o_ws + (split * p.total_rows + ws_row(r)) * p.d + c4 * 4) = acc;
        }
      }
      if (tid < 16 && r0 + tid < p.rows) {
        const float lse = red[2 * NW * 16 + tid];
        if (direct) {
          store_lse(r0 + tid, lse);
        } else {
          p.lse_ws[split * p.total_rows + ws_row(r0 + tid)] = lse;
        }
      }
      FG_PROBE(4);
      if (!fused) return;
      __syncthreads();  // every thread's partial stores, before the release below
      if (tid == 0) red_release_add(ctr + 1, 1);
      FG_PROBE(5);
      return;
    }

    // ---- the merger (the others' partials are in: see above): merge them with its own ----
    // Its own partial O, summed over the warps, goes to shared memory after the warps' scratch.
    float* const s_own = s_o + NW * 16 * OS;  // [16][D]
    for (int i = tid; i < 16 * (D / 4); i += NT) {
      const int row = i / (D / 4), c4 = i % (D / 4);
      if (r0 + row >= p.rows || c4 * 4 >= p.d) continue;
      *reinterpret_cast<float4*>(s_own + row * D + c4 * 4) = own_o(row, c4);
    }
    __syncthreads();  // s_own written
    FG_PROBE(5);
    // Each thread merges one (row, 4 columns) item over every split (decode_merge.cuh: merge_splits).
    const fg_i64 l_step = p.total_rows, o_step = static_cast<fg_i64>(p.total_rows) * p.d;
    for (int i = tid; i < 16 * (D / 4); i += NT) {
      const int row = i / (D / 4), c4 = i % (D / 4);
      const int r = r0 + row;
      if (r >= p.rows || c4 * 4 >= p.d) continue;
      const fg_i64 wr = ws_row(r);
      const float* const l_r = p.lse_ws + wr;
      const float* const o_r = p.o_ws + wr * p.d + c4 * 4;
      const float* const own_l = red + 2 * NW * 16 + row;
      const float* const own = s_own + row * D + c4 * 4;
      float4 o;
      float lse;
      float sink = 0.f;
      if constexpr (VAR::SINK) sink = p.sinks[VAR::head_of(p, hk, r)];
      merge_splits<VAR::SINK>(o_r, l_r, o_step, l_step, p.num_splits, split, own, own_l, o, lse, sink);
      store_o(r, c4, o);
      if (c4 == 0) store_lse(r, lse);
    }
    FG_PROBE(6);
  }
};

// The kernel: the stages of decode_split_cta in order.
template <int D, int BN, int NW, int ST, bool FP8, bool BF16, int KV_LOAD, typename VAR, typename Params>
FG_DEVICE void decode_split_body(const Params& p) {
  int wb, win_lo, win_hi;  // the block-table window (decode_split_cta::step_window)
  decode_split_cta<D, BN, NW, ST, FP8, BF16, KV_LOAD, VAR, Params> cta(p, wb, win_lo, win_hi);
  cta.append(p);
  cta.load_q(p);
  cta.main_loop(p);  // (and the epilogue)
}
