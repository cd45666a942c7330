// Shared-memory tiles of ROWS x D 16-bit elements, stored as rows of C = D/8
// 16-byte chunks with an XOR swizzle so that ldmatrix (8 rows, one chunk
// column) and cp.async (consecutive chunks) hit distinct banks.
#pragma once

template <int D>
struct Tile {
  static constexpr int C = D / 8;  // 16-byte chunks per row
  static_assert(C % 4 == 0, "head-dim tile must be a multiple of 32");

  // Physical chunk of logical chunk c in row r. Eight consecutive rows at the
  // same c must land in eight different 16-byte bank groups.
  //  - C % 8 == 0: rows start in the same bank group; XOR with r % 8.
  //  - C % 8 == 4: rows alternate between two half-groups; the full 8-chunk
  //    blocks still use c ^ (r % 8) (the row parity flips bit 2, a bijection),
  //    the last 4 chunks use c ^ ((r / 2) % 4).
  static FG_DEVICE int swz(int r, int c) {
    if constexpr (C % 8 == 0) {
      return c ^ (r & 7);
    } else {
      constexpr int T = C - 4;
      return c < T ? (c ^ (r & 7)) : T + ((c - T) ^ ((r >> 1) & 3));
    }
  }
  static FG_DEVICE fg_u32 offset(int r, int c) { return static_cast<fg_u32>((r * C + swz(r, c)) * 16); }

  // Byte offsets, within a row, of logical chunk 2*kk + c0 for every kk, for a
  // lane whose rows are r + 16*m. The swizzle depends only on r % 8 (and
  // (r / 2) % 4 in the tail), so six registers serve all kk and all m; with kk
  // a compile-time constant, col(kk) is one register plus an immediate. (Written
  // as offset(r, 2*kk + c0) the compiler keeps one register per kk.)
  struct Cols {
    fg_u32 main[4];
    fg_u32 tail[2];
    FG_DEVICE Cols(int r, int c0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) main[i] = static_cast<fg_u32>(16 * ((2 * i + c0) ^ (r & 7)));
#pragma unroll
      for (int i = 0; i < 2; ++i)
        tail[i] = static_cast<fg_u32>(16 * ((C & ~7) + ((2 * i + c0) ^ ((r >> 1) & 3))));
    }
    FG_DEVICE fg_u32 col(int kk) const {
      return 2 * kk < (C & ~7) ? 128 * (kk >> 2) + main[kk & 3] : tail[kk - (C & ~7) / 2];
    }
  };
  static constexpr int ROW_BYTES = C * 16;

  // Copy rows [row0, row0 + ROWS) of a row-major matrix (row stride `stride`
  // elements) into the tile at shared address `base`. Rows >= n_rows and
  // chunks at or past column d are zero-filled, so padding never reads memory.
  template <int ROWS, int THREADS>
  // `tix`: the thread's index (a caller in a loop may pass an opaque copy so the
  // per-thread offsets are recomputed per call instead of held across the loop).
  static FG_DEVICE void load(fg_u32 base, const elem_t* g, fg_i64 stride, int row0, int n_rows, int d,
                             int tix = static_cast<int>(threadIdx.x)) {
    if constexpr (THREADS % C == 0 && ROWS % (THREADS / C) == 0) {
      // Each thread keeps one chunk column and walks rows THREADS/C apart with
      // a running pointer, so no per-iteration address stays live in registers.
      constexpr int STEP = THREADS / C;
      const int c = tix % C, r = tix / C;
      const bool col_ok = c * 8 < d;
      const elem_t* src = g + static_cast<fg_i64>(row0 + r) * stride + c * 8;
      const fg_i64 src_step = static_cast<fg_i64>(STEP) * stride;
#pragma unroll
      for (int it = 0; it < ROWS / STEP; ++it) {
        const int rr = r + it * STEP;
        const bool ok = col_ok && row0 + rr < n_rows;
        const fg_u32 dst = STEP % 8 == 0 ? base + offset(r, c) + it * STEP * ROW_BYTES : base + offset(rr, c);
        cp_async_16(dst, ok ? src : g, ok ? 16 : 0);
        src += src_step;
      }
    } else {
      constexpr int CHUNKS = ROWS * C;
#pragma unroll
      for (int it = 0; it < (CHUNKS + THREADS - 1) / THREADS; ++it) {
        const int i = it * THREADS + tix;
        if (CHUNKS % THREADS != 0 && i >= CHUNKS) break;
        const int r = i / C, c = i % C;
        const bool ok = (row0 + r < n_rows) && (c * 8 < d);
        const elem_t* src = ok ? g + static_cast<fg_i64>(row0 + r) * stride + c * 8 : g;
        cp_async_16(base + offset(r, c), src, ok ? 16 : 0);
      }
    }
  }
};
