"""fwd_v2: FlashAttention-2's forward with mma.sync m16n8k16, ldmatrix and a cp.async ring (every arch).

Split-Q: each warp owns block_m / warps query rows (16-row slices) of one
(batch, head); K/V blocks of block_n rows stream through ``stages`` shared-memory
stages; ``refill`` says where in the loop the next block's copy is issued. User mods (``mod``:
score_mod / mask_mod, templates/common/mod.cuh) run here as in fwd_sm90, for the GPUs without it.
templates/fwd_v2/.
"""
from __future__ import annotations

from ..problem import ProblemKey
from ..variants import PLAIN
from .base import (FWD_O32_PARAMS, FWD_PARAMS, MOD_PARAMS, MOD_ROWS_PARAMS, VARIANT_PARAMS, VARLEN_PARAMS, Family,
                   check_mod, forward_values, mod_context, variant_context, varlen_pairs)

# The default rule: per head-dim tile, (block_m, block_n, warps, stages, refill, causal, arch) in
# order of preference, None meaning any; the first that fits the GPU's shared memory is used.
# Chosen from FA2's tiles and H200 sweeps (docs/perf/forward-mma.md), kept to tiles that compile
# without spills (tests/test_compile.py checks every one).
DEFAULT_TILES = {
    32: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    64: ((128, 64, 4, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    96: ((128, 64, 8, 2, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    128: ((128, 64, 4, 2, 1, True, "sm_90a"), (128, 48, 4, 3, 0, False, "sm_90a"),
          (128, 32, 4, 3, 0, None, None), (64, 64, 4, 2, 0, None, None)),
    160: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    192: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    224: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
    256: ((128, 64, 8, 2, 0, None, None), (64, 32, 4, 2, 0, None, None)),
}


class FwdV2Family(Family):
    REFILLS = (0, 1, 2)

    def value_rules(self) -> tuple:
        return (*super().value_rules(), ("refill", self.REFILLS))

    def validate(self, spec) -> None:
        super().validate(spec)
        check_mod(self, spec)

    def context(self, spec) -> dict:
        return {**super().context(spec), **variant_context(spec), **mod_context(spec)}

    def rule(self, key: ProblemKey, budget: int) -> list:
        out = []
        for bm, bn, w, st, refill, causal, arch in self.tiles[self.tile(key)]:
            if (causal is not None and causal != key.causal) or (arch is not None and arch != key.arch):
                continue
            self._fit(out, self.spec(key, block_m=bm, block_n=bn, warps=w, stages=st, refill=refill), budget)
        return self._fitting(out, key, budget)

    def launch(self, kern, dims, strides_bhs, o_strides, scale, dev, variant=PLAIN):
        """(grid, params_for) of one launch: ``params_for(q_ptr, k_ptr, v_ptr)`` gives the parameter block
        with the input pointers set (o, lse and the variant's slope and sink pointers are the caller's);
        ``variant`` (flashgen.variants.Variant) gives the window and softcap values; ``dev`` is unused here.
        Packed rows (``variant.varlen``): ``dims`` = (sequences, h, hk, total_q, total_k, d); the grid's x
        is the bound on the device-built work list (common/varlen.cuh), the list and the sequence pointers
        are the caller's."""
        b, h, _, nq, nk, _ = dims
        template = kern.params(**{**forward_values(dims, strides_bhs, o_strides, scale),
                                  **variant.values(nq, nk, scale)})
        if variant.varlen:
            template.seqs = b
        struct, blob = type(template), bytes(template)

        def params_for(q_ptr, k_ptr, v_ptr):
            params = struct.from_buffer_copy(blob)
            params.q, params.k, params.v = q_ptr, k_ptr, v_ptr
            return params

        if variant.varlen:
            return (varlen_pairs(nq, b, kern.spec.block_m), h, 1), params_for
        return ((nq + kern.spec.block_m - 1) // kern.spec.block_m, h, b), params_for


FAMILY = FwdV2Family(
    "fwd_v2", "fwd_v2/fwd_v2.cu.j2",
    FWD_PARAMS + VARIANT_PARAMS + FWD_O32_PARAMS + VARLEN_PARAMS + MOD_PARAMS + MOD_ROWS_PARAMS,
    problem="fwd", tiles=DEFAULT_TILES,
    tune_space=(("block_m", (64, 128, 192)), ("block_n", (32, 48, 64, 96, 128)), ("warps", (4, 8)),
                ("stages", (2, 3, 4)), ("refill", (0, 1, 2))))
