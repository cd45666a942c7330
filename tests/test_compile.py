"""Tier 2: every spec dispatch can pick compiles with NVRTC, without spills, within limits.

No GPU is needed: NVRTC compiles cubins offline. The specs are compiled once
per run (conftest's ``compile_session``, shared with the other compile-tier
modules), one per CPU at a time (NVRTC releases the GIL), into a private
FLASHGEN_HOME; each spec is then its own test item so a failure names it.

Dispatch can pick the default rules' specs (``flashgen.families.rule_specs``: every
family's, the decode regimes' and the fallbacks the torch layer takes, e.g. the
mma.sync bwd_dkdv tiles on sm_90a) and every spec of a shipped tuning table
(flashgen/generated/*.yaml): all are compiled here.
"""
from __future__ import annotations


import pytest

from flashgen import dispatch, families, gpus, tables
from flashgen.codegen import parse_ptxas_log
from flashgen.errors import UnsupportedError
from flashgen.families import bwd, bwd_sm90, decode, fwd_v1, fwd_v2, paged_spec, standard
from flashgen.families.decode import PAGE_SIZES
from flashgen.problem import BUCKETS, HEAD_DIM_TILES, ProblemKey, bwd_head_dim_tile
from flashgen.spec import DTYPES
from build_util import clean_binary

ARCHES = ("sm_80", "sm_90a")
BUDGET_OF = gpus.ARCH_SMEM_PER_BLOCK
# Every spec a default rule can give dispatch, per arch (forward, decode split and combine, backward,
# the study families; the backward's mma.sync fallback on sm_90a).
SPECS = [s for arch in ARCHES for s in families.rule_specs(arch, gpus.ARCH_SMEM_PER_BLOCK[arch])]
# The sm_90a bulk loader (kv_load 4, 5) on each d=128 default decode tile: not a default yet, measured as
# a decode loader variant (docs/perf/decode.md), so it must stay spill-free too.
BULK_SPECS = sorted({s.replace(kv_load=h).validate() for s in SPECS
                     if s.kind == "decode_split" and s.arch == "sm_90a" and s.head_dim == 128 and not s.fp8
                     for h in (4, 5)},
                    key=lambda s: s.name)
# Every spec a shipped tuned table (flashgen/generated/*.yaml) can pick, for that table's arch.
SHIPPED_SPECS = sorted({e["spec"] for gpu in tables.shipped_gpus()
                        for e in tables.load(tables.shipped_path(gpu), gpu=gpu).entries.values()},
                       key=lambda s: s.name)
# A sample of the variant kernels dispatch picks (flashgen.variants; a key's variant rides on the plain
# rule's tile): the forward's with a window and with all four switches, on both arches; the mma.sync
# backward's with a window, a softcap and ALiBi together (every dK/dV and dQ kernel); the Hopper backward's
# with one switch each (its window + softcap pair at d = 128 spills and falls back to the mma.sync kernel:
# flashgen.api.backward), and its split tiles (192, 256) with three together.
VARIANT_SPECS = sorted(
    {families.default_spec(ProblemKey("fwd", arch, "bf16", d, c, 512, v), BUDGET_OF[arch])
     for arch in ARCHES for d in (64, 128) for c in (False, True) for v in ("win", "win_cap_alibi_sink")}
    | {families.default_spec(ProblemKey(kind, "sm_90a", "bf16", 128, c, 512, "win_cap_alibi"), BUDGET_OF["sm_90a"],
                             family=fam)
       for kind, fam in (("bwd_dkdv", "bwd_dkdv"), ("bwd_dkdv_nodq", None), ("bwd_dq", None)) for c in (False, True)}
    | {families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, True, 512, v), BUDGET_OF["sm_90a"],
                             family="bwd_sm90") for d in (64, 128) for v in ("win", "cap")}
    | {families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, c, 512, "win_cap_alibi"), BUDGET_OF["sm_90a"],
                             family="bwd_sm90") for d in (192, 256) for c in (False, True)},
    key=lambda s: s.name)
# The decode kernels with each variant switch alone and with all four, on every tile the decode rule picks
# (every head dim, dtype and regime of both arches, with a 16-bit and with an FP8 cache): a variant key
# takes the plain key's tile (decode_split's rule). Every combination of switches on those tiles compiled clean once (300 kernels);
# these are the ones the tier keeps building.
DECODE_VARIANTS = ("win", "cap", "alibi", "sink", "win_cap_alibi_sink")
# Dispatch's causal ALiBi picks on Hopper, which take the bias's column part in S's GEMM (dispatch.with_bias_gemm)
# where it builds: every shipped table's, both 16-bit dtypes, with and without sinks.
BIAS_GEMM_PICKS = sorted({dispatch.select(ProblemKey("fwd", "sm_90a", dt, d, True, n, v), gpu, BUDGET_OF["sm_90a"])
                          for gpu in tables.shipped_gpus() for dt in DTYPES for d in (64, 128, 256)
                          for n in (1024, 8192) for v in ("alibi", "alibi_sink")}, key=lambda s: s.name)
DECODE_VARIANT_SPECS = sorted({s.with_tokens(v).validate() for s in SPECS if s.kind == "decode_split"
                               for v in DECODE_VARIANTS}, key=lambda s: s.name)
# Packed rows (varlen): every shipped forward entry with the switch (dispatch runs the plain entry's tile
# for a varlen key), the forward's rule with a window and with all four switches on both arches, and
# the backward's kernels for a varlen key (the Hopper dK/dV kernel and the mma.sync ones).
VARLEN_SPECS = sorted(
    {s.replace(varlen=True).validate() for s in SHIPPED_SPECS if s.kind in ("fwd_sm90", "fwd_v2")}
    | {families.default_spec(ProblemKey("fwd", arch, "bf16", d, c, 512, v), BUDGET_OF[arch])
       for arch in ARCHES for d in (64, 128) for c in (False, True) for v in ("vl", "win_vl", "win_cap_alibi_sink_vl")}
    | {families.default_spec(ProblemKey(kind, "sm_90a", "bf16", d, c, 512, "vl"), BUDGET_OF["sm_90a"], family=fam)
       for kind, fam in (("bwd_dkdv", "bwd_sm90"), ("bwd_dkdv", "bwd_dkdv"), ("bwd_dkdv_nodq", None), ("bwd_dq", None))
       for d in (64, 128) for c in (False, True)}
    | {families.default_spec(ProblemKey("bwd_dkdv", "sm_90a", "bf16", d, c, 512, "vl"), BUDGET_OF["sm_90a"],
                             family="bwd_sm90") for d in (192, 256) for c in (False, True)},
    key=lambda s: s.name)
# Paged K/V (attention_varlen with a block table): every fwd_sm90 kernel of VARLEN_SPECS in the paged form
# each page size gives it (families.paged_spec: boxes of gcd(page, block_n) rows), and the warp-specialized
# ones with their rows gathered by cp.async (kv_gather) at pages of 16.
PAGED_SPECS = sorted({paged_spec(s, page) for s in VARLEN_SPECS if s.kind == "fwd_sm90" for page in PAGE_SIZES}
                     | {paged_spec(s, 16, gather=True) for s in VARLEN_SPECS
                        if s.kind == "fwd_sm90" and s.warp_specialized},
                     key=lambda s: s.name)
# deterministic=True: the det twin of every Hopper dK/dV kernel a plain key can get (api.backward.deterministic_sm90;
# a variant's twin that spills is refused there, and the mma.sync pair serves it, as it does where none fits).
DET_SPECS = sorted({t for s in SPECS + SHIPPED_SPECS if s.kind == "bwd_sm90"
                    for t in [dispatch.deterministic_twin(s, BUDGET_OF[s.arch])] if t is not None},
                   key=lambda s: s.name)
ALL_SPECS = list(dict.fromkeys(SPECS + BULK_SPECS + SHIPPED_SPECS + VARIANT_SPECS + BIAS_GEMM_PICKS
                               + DECODE_VARIANT_SPECS + VARLEN_SPECS + PAGED_SPECS + DET_SPECS))  # each spec once, in that order
BUDGET = gpus.ARCH_SMEM_PER_BLOCK
BASELINE_KINDS = (*standard.KINDS, fwd_v1.KIND)


@pytest.fixture(scope="module")
def compiled(compile_session):
    """{spec: Binary or the exception its build raised}, compiled in parallel (once per run)."""
    return compile_session.build_all(ALL_SPECS)


def _keys(problem: str, arch: str) -> list:
    """Every key of ``problem`` dispatch may be asked for on ``arch``: the key of every input head dim
    (multiples of 8 up to 256, mapped to the problem's key tiles), dtype, mask (decode: causal only) and
    sequence bucket (bwd_sm90's rule takes the dQ writer from a bucket on)."""
    masks = (True,) if problem == "decode_split" else (False, True)
    keys = [families.problem_key(problem, arch, dt, d, c, n) for d in range(8, 257, 8) for dt in DTYPES
            for c in masks for n in BUCKETS]
    if problem in ("decode_split", "fwd"):  # and FP8's (an FP8 cache, FP8 inputs: their own tiles)
        keys += [k.replace(variant="fp8") for k in keys]
    return list(dict.fromkeys(keys))


def _picked(problem: str, arch: str) -> list:
    """The default rule's pick for every key of ``problem`` on ``arch`` (each decode regime for the split
    kernel; the combine kernel of every (dtype, head-dim tile); also the fallback family's for a problem
    the torch layer falls back in), each spec once; a key no tile of the budget fits has no pick."""
    if problem == "decode_combine":
        return [decode.COMBINE.spec_for(arch, dt, d) for d in decode.DECODE_HEAD_DIMS for dt in DTYPES]
    budget, out = BUDGET[arch], []
    for key in _keys(problem, arch):
        picks = [{}] if problem != "decode_split" else [{"regime": r} for r in decode.REGIMES]
        if problem in families.FALLBACK_REACHABLE:
            picks.append({"family": families.fallback_family(problem, arch)})
        for args in picks:
            try:
                spec = families.default_spec(key, budget, **args)
            except UnsupportedError:
                continue
            if spec not in out:
                out.append(spec)
    return out


def test_default_specs_cover_every_key():
    """SPECS holds the default rule's spec for every (head dim, dtype, causal, bucket) forward key of each arch:
    one per key on sm_80 (fwd_v2's tiles), shared between head dims on the same fwd_sm90 tile and between the
    buckets of a range of fwd_sm90.DENSE_FIRST on sm_90a (FP8 inputs' keys:
    test_rule_specs_are_the_picks_of_every_key)."""
    assert len(SPECS) == len(set(SPECS))
    fwd = [s for s in SPECS if families.family(s.kind).serves == "fwd" and not getattr(s, "fp8", False)]
    assert len([s for s in fwd if s.arch == "sm_80"]) == len(fwd_v2.DEFAULT_TILES) * 2 * 2
    for arch in ARCHES:
        keys = [ProblemKey("fwd", arch, dt, d, c, n)
                for d in fwd_v2.DEFAULT_TILES for dt in ("fp16", "bf16") for c in (False, True) for n in BUCKETS]
        budget = BUDGET[arch]
        assert {families.default_spec(k, budget) for k in keys} == {s for s in fwd if s.arch == arch}


@pytest.mark.parametrize("arch", ARCHES)
def test_rule_specs_are_the_picks_of_every_key(arch):
    """For every problem, the default rule's pick of each of its keys (every input head dim, dtype, mask,
    decode regime, fallback family) is compiled here, and SPECS holds nothing dispatch cannot pick; every
    problem has specs on each arch."""
    picked = {problem: _picked(problem, arch) for problem in families.problems()}
    compiled_here = {s for s in SPECS if s.arch == arch}
    for problem, specs in picked.items():
        assert specs, (problem, arch)
        assert set(specs) <= compiled_here, (problem, sorted(s.name for s in set(specs) - compiled_here))
    assert set().union(*map(set, picked.values())) == compiled_here


def test_bwd_default_specs_cover_every_key():
    """The backward rule has a spec per (kind, head-dim tile, dtype, causal) for each arch; the row
    kernels (preprocess, convert) have no causal variant, so one spec serves both keys. On sm_90a the
    bwd_dkdv problem's keys take bwd_sm90 specs (families.default_family; no 160 key there, its head dims on
    192's), and the mma.sync bwd_dkdv tiles the torch layer falls back to there (families.fallback_family) are
    compiled too."""
    assert len(bwd.DKDV_TILES) == len(bwd.BWD_HEAD_DIMS)
    bwd_problems = ("bwd_preprocess", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq", "bwd_convert")
    assert set(bwd_problems) == {families.family(k).serves for k in families.FAMILIES if k.startswith("bwd")}
    for arch in ARCHES:
        budget = BUDGET[arch]
        key_tiles = sorted({bwd_head_dim_tile(d, arch) for d in bwd.BWD_HEAD_DIMS})
        assert (160 in key_tiles) == (arch != "sm_90a")
        tiles = len(key_tiles)
        for problem in bwd_problems:
            keys = [ProblemKey(problem, arch, dt, d, c, 512) for d in key_tiles for dt in DTYPES
                    for c in (False, True)]
            specs = list(dict.fromkeys(families.default_spec(k, budget) for k in keys))
            assert set(specs) <= set(SPECS)
            causal_variants = 1 if problem in ("bwd_preprocess", "bwd_convert") else 2
            assert len(specs) == tiles * 2 * causal_variants, problem
            sm90 = {s.head_dim for s in specs if s.kind == "bwd_sm90"}
            assert sm90 == (set(bwd_sm90.BWD_SM90_TILES) if arch == "sm_90a" and problem == "bwd_dkdv" else set())
            if problem == "bwd_dkdv":
                fallback = {families.default_spec(k, budget, family=families.fallback_family(problem, arch))
                            for k in keys}
                assert {s.kind for s in fallback} == {"bwd_dkdv"} and len(fallback) == tiles * 2 * 2
                assert fallback <= set(SPECS)


def test_every_baseline_kind_has_a_default_per_key():
    """Each baseline kind (standard attention's passes, fwd_v1) has one default per (arch, head-dim tile, dtype, causal)."""
    for kind in BASELINE_KINDS:
        for arch in ARCHES:
            specs = [s for s in SPECS if s.kind == kind and s.arch == arch]
            assert len(specs) == len(HEAD_DIM_TILES) * 4, (kind, arch)


def test_decode_defaults_cover_every_regime():
    """The decode rule's spec of every (head-dim tile, dtype, regime), with a 16-bit and with an FP8 cache,
    and the combine kernel of every (head-dim tile, dtype) are compiled, with the bulk loaders on the
    sm_90a d=128 16-bit tiles."""
    for arch in ARCHES:
        for d in decode.DECODE_HEAD_DIMS:
            for dt in DTYPES:
                key = ProblemKey("decode_split", arch, dt, d, True, 512)
                for regime in decode.REGIMES:
                    assert decode.first_rule_spec(key, BUDGET[arch], regime) in SPECS, (key, regime)
                    fp8 = decode.first_rule_spec(key.replace(variant="fp8"), BUDGET[arch], regime)
                    assert fp8.fp8 and fp8 in SPECS, (key, regime)
                assert decode.COMBINE.spec_for(arch, dt, d) in SPECS
    tile = lambda s: (s.dtype, s.block_n, s.warps, s.stages)  # noqa: E731
    d128 = {tile(s) for s in SPECS
            if s.kind == "decode_split" and s.arch == "sm_90a" and s.head_dim == 128 and not s.fp8}
    assert {(tile(s), s.kv_load) for s in BULK_SPECS} == {(t, h) for t in d128 for h in (4, 5)}


def test_decode_variant_picks_are_compiled():
    """The decode rule's pick for a variant key (every head dim, dtype, regime, arch; each switch alone and
    all four) is the plain key's tile with the variant's switches, and is among the compiled specs."""
    for arch in ARCHES:
        for d in decode.DECODE_HEAD_DIMS:
            for dt in DTYPES:
                for regime in decode.REGIMES:
                    plain = decode.first_rule_spec(ProblemKey("decode_split", arch, dt, d, True, 512), BUDGET[arch],
                                                   regime)
                    for v in DECODE_VARIANTS:
                        spec = decode.first_rule_spec(ProblemKey("decode_split", arch, dt, d, True, 512, v),
                                                      BUDGET[arch], regime)
                        assert spec == plain.with_tokens(v) and spec in DECODE_VARIANT_SPECS, (arch, d, dt, regime, v)


def test_v1_defaults_follow_the_paper_rule_where_it_fits():
    """fwd_v1's default tiles never exceed the paper's B_r = min(B_c, d), B_c = ceil(M/4d) (M in elements)."""
    from flashgen.iomodel import paper_block_sizes

    v1 = [s for s in SPECS if s.kind == fwd_v1.KIND]
    assert v1
    for s in v1:
        br, bc = paper_block_sizes(gpus.ARCH_SMEM_PER_BLOCK[s.arch], s.head_dim)
        assert s.block_m <= br and s.block_n <= bc, s.name


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_default_spec_compiles_clean(spec, compiled):
    """NVRTC compiles the spec for its arch into an ELF cubin; ptxas reports no spill, no stack frame,
    at most 255 registers, and static plus dynamic shared memory within the arch's per-block budget."""
    binary = clean_binary(compiled, spec)  # ELF, no spill, no stack frame, no ptxas problem
    report = binary.report
    assert binary.name == spec.name and binary.arch == spec.arch
    assert f"Function properties for {spec.name}" in binary.log
    assert 0 < report.registers <= 255, binary.log
    assert report.static_smem + spec.smem_bytes() <= gpus.ARCH_SMEM_PER_BLOCK[spec.arch]


CANNED_LOG = """\
ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function 'small_kernel' for 'sm_80'
ptxas info    : Function properties for small_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 38 registers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'fwd_v2_d256_m128_n128_w4_s3_full_bf16_sm80' for 'sm_80'
ptxas info    : Function properties for fwd_v2_d256_m128_n128_w4_s3_full_bf16_sm80
ptxas         .     1176 bytes stack frame, 1312 bytes spill stores, 1288 bytes spill loads
ptxas info    : Used 255 registers, 2048 bytes smem, 400 bytes cmem[0]
ptxas warning : Registers are spilled to local memory in function 'fwd_v2_d256_m128_n128_w4_s3_full_bf16_sm80', 1312 bytes spill stores, 1288 bytes spill loads
"""


def test_parse_ptxas_log_with_spills():
    """The report of a named kernel is read from its own section of a multi-kernel log, spills and
    stack included, and problems() refuses it for each reason."""
    r = parse_ptxas_log(CANNED_LOG, "fwd_v2_d256_m128_n128_w4_s3_full_bf16_sm80")
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.static_smem) == (255, 1312, 1288, 1176, 2048)
    assert len(r.warnings) == 1 and "spilled" in r.warnings[0]
    problems = r.problems()
    assert any("1312 B stored" in p and "1288 B loaded" in p for p in problems)
    assert any("stack frame of 1176 B" in p for p in problems)
    assert any(p.startswith("ptxas warning") for p in problems)
    assert not any("registers >" in p for p in problems)  # 255 is allowed
    assert any("255 registers > 128" in p for p in r.problems(max_registers=128))


def test_parse_ptxas_log_clean_kernel():
    """The first kernel of the same log is clean: its own numbers, not the spilling kernel's."""
    r = parse_ptxas_log(CANNED_LOG, "small_kernel")
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.static_smem) == (38, 0, 0, 0, 1024)


def test_parse_ptxas_log_of_an_empty_log():
    """A log without a report parses to zeros rather than raising; the compile test's
    ``registers > 0`` is what catches a kernel whose report is missing."""
    r = parse_ptxas_log("", "anything")
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.static_smem) == (0, 0, 0, 0, 0)
    assert r.warnings == ()


def test_an_empty_ptxas_log_is_a_problem():
    """NVRTC 13.0 returns an empty log on a compute-cache hit; a binary without a resource report is
    refused rather than trusted (nothing would show its spills), and the compute cache is off."""
    import os

    r = parse_ptxas_log("", "fwd_v2_d128_m128_n64_w4_s2_r1_causal_bf16_sm90a")
    assert r.registers == 0
    assert any("no ptxas resource usage" in p for p in r.problems())
    assert os.environ.get("CUDA_CACHE_DISABLE") == "1"


def test_each_compile_misses_the_compute_cache_with_the_same_cubin(monkeypatch):
    """CUDA_CACHE_DISABLE helps only when set before NVRTC loads, so every NVRTC compile also carries a
    macro of its own: no compute-cache hit (which would hide the ptxas report), and the same cubin."""
    from cupy_backends.cuda.libs import nvrtc

    from flashgen.codegen import compiler

    seen = []
    real = nvrtc.compileProgram
    monkeypatch.setattr(nvrtc, "compileProgram", lambda prog, opts: (seen.append(list(opts)), real(prog, opts))[1])
    src = 'extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }'
    a, b = (compiler.compile_source(src, "sm_90a", "twice") for _ in range(2))
    assert a.cubin == b.cubin and a.key == b.key
    assert a.report.registers > 0 and b.report.registers > 0
    nonces = [[o for o in opts if o.startswith("-DFLASHGEN_COMPILE_NONCE=")] for opts in seen]
    assert [len(n) for n in nonces] == [1, 1] and nonces[0] != nonces[1]
    assert all(opts[:-1] == compiler.compile_options("sm_90a") for opts in seen)
