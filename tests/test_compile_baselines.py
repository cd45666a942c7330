"""Tier 2 for the baselines: every default spec of standard attention's three passes and of fwd_v1
compiles with NVRTC for sm_80 and sm_90a, without spills, within limits (as tests/test_compile.py
does for fwd_v2)."""
from __future__ import annotations

from multiprocessing.pool import ThreadPool

import pytest

from flashgen import dispatch, gpus
from flashgen.baseline_specs import STANDARD_KINDS, V1_KIND
from flashgen.codegen import build

ARCHES = ("sm_80", "sm_90a")
KINDS = (*STANDARD_KINDS, V1_KIND)
SPECS = sorted({s for kind in KINDS for arch in ARCHES
                for s in dispatch.default_specs(arch, gpus.ARCH_SMEM_PER_BLOCK[arch], kind=kind)},
               key=lambda s: s.name)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    def one(spec):
        try:
            return spec, build(spec)
        except Exception as exc:  # noqa: BLE001 -- reported per spec below
            return spec, exc

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHGEN_HOME", str(tmp_path_factory.mktemp("compile_home")))
        mp.delenv("FLASHGEN_NO_COMPILE", raising=False)
        with ThreadPool(2) as pool:
            return dict(pool.map(one, SPECS))


def test_every_kind_has_a_default_per_key():
    """Each kind has one default per (arch, head-dim tile, dtype, causal)."""
    for kind in KINDS:
        for arch in ARCHES:
            specs = [s for s in SPECS if s.kind == kind and s.arch == arch]
            assert len(specs) == len(dispatch.DEFAULT_TILES) * 4, (kind, arch)


def test_v1_defaults_follow_the_paper_rule_where_it_fits():
    """fwd_v1's default tiles never exceed the paper's B_r = min(B_c, d), B_c = ceil(M/4d) (M in elements)."""
    from flashgen.iomodel import paper_block_sizes

    for s in SPECS:
        if s.kind == V1_KIND:
            br, bc = paper_block_sizes(gpus.ARCH_SMEM_PER_BLOCK[s.arch], s.head_dim)
            assert s.block_m <= br and s.block_n <= bc, s.name


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_default_spec_compiles_clean(spec, compiled):
    """ELF cubin, the kernel's own ptxas section, no spill, no stack frame, <= 255 registers, shared memory
    within the arch's budget."""
    binary = compiled[spec]
    if isinstance(binary, Exception):
        raise binary
    report = binary.report
    assert binary.cubin[:4] == b"\x7fELF"
    assert f"Function properties for {spec.name}" in binary.log
    assert report.spill_stores == 0 and report.spill_loads == 0, binary.log
    assert report.stack_frame == 0, binary.log
    assert 0 < report.registers <= 255, binary.log
    assert report.static_smem + spec.smem_bytes() <= gpus.ARCH_SMEM_PER_BLOCK[spec.arch]
    assert report.problems() == []
