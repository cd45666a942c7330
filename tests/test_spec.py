"""KernelSpec, kernel families, GPU profiles and dispatch: pure Python, no GPU, no compiler."""
from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from flashgen import ConfigError, KernelSpec, UnsupportedError, dispatch, families, gpus
from flashgen.families import FAMILIES
from flashgen.problem import HEAD_DIM_TILES, ProblemKey, bucket_of, head_dim_tile
from flashgen.spec import ARCHS, DTYPES, fields_of

FWD = FAMILIES["fwd_v2"]

NAME_RE = re.compile(r"^fwd_v2_d\d+_m\d+_n\d+_w\d+_s\d+(_r[12])?(_win)?(_cap)?(_alibi)?(_sink)?(_vl)?(_mod\d+)?(_rb)?_(causal|full)_(fp16|bf16)"
                     r"_sm\d+a?$")


def _allowed(field: str) -> tuple:
    """The values of one KernelSpec field that the fwd_v2 family supports (read from the code)."""
    fixed = {"kind": tuple(FAMILIES), "arch": ARCHS, "dtype": DTYPES, "causal": (False, True),
             "refill": FWD.REFILLS, **{f: (False, True) for f in VARIANT_FIELDS}, "mod": (0, 5)}
    if field in fixed:
        return fixed[field]
    for attr in (field + "s", field):  # head_dim -> head_dims, warps -> warps
        values = getattr(FWD, attr, None)
        if isinstance(values, tuple):
            return values
    raise KeyError(f"the tests do not know where the allowed values of KernelSpec.{field} live")


FIELDS = [f.name for f in fields_of("fwd_v2")]
# compile-time switches (and a user mod's token): off over the grid below
VARIANT_FIELDS = ("window", "softcap", "alibi", "sinks", "varlen", "mod", "row_bounds")


def _valid_specs():
    """Every fwd_v2 spec that passes validate(), over the product of every field's supported values
    (the decode and backward families have their own rules and tests)."""
    for values in itertools.product(*(("fwd_v2",) if f == "kind" else (_allowed(f)[0],) if f in VARIANT_FIELDS
                                      else _allowed(f) for f in FIELDS)):
        spec = KernelSpec(**dict(zip(FIELDS, values)))
        if spec.block_m % (16 * spec.warps) == 0:
            yield spec


# ---------------------------------------------------------------- names


def test_name_format_of_a_known_spec():
    """The name spells every field in the documented order, arch without its underscore."""
    spec = KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128, block_n=64,
                      warps=4, stages=2, causal=True)
    assert spec.name == "fwd_v2_d128_m128_n64_w4_s2_causal_bf16_sm90a"
    assert (spec.replace(causal=False, arch="sm_80", dtype="fp16", refill=2).name
            == "fwd_v2_d128_m128_n64_w4_s2_r2_full_fp16_sm80")


def test_names_are_unique_identifiers_over_the_whole_grid():
    """Over every valid fwd_v2 spec, names are distinct, match the format and are C identifiers
    (the name is the kernel symbol, the file name and the cache key)."""
    specs = list(_valid_specs())
    names = [s.name for s in specs]
    assert len(specs) > 10_000
    assert len(set(names)) == len(names) == len(set(specs))
    for n in names[:: max(1, len(names) // 997)]:
        assert NAME_RE.match(n), n
        assert n.isidentifier(), n


# kind is the name's first word; the other families refuse fwd_v2's tile values, so it is not varied here.
# The other kinds' own fields are not fwd_v2's (tests/test_sm90.py and the name tests below cover them).
@pytest.mark.parametrize("field", [f for f in FIELDS if f != "kind" and len(_allowed(f)) > 1])
def test_every_field_changes_the_name(field):
    """Changing any one field to another valid value changes the name: the name covers the field list
    (a field added to KernelSpec is covered here without touching this test)."""
    base = KernelSpec(kind="fwd_v2", arch="sm_80", dtype="fp16", head_dim=96, block_m=64, block_n=64, warps=2,
                      stages=3, causal=False).validate()
    if field == "row_bounds":  # (a mod's option: compared with the same mod without it)
        base = base.replace(mod=5).validate()
    others = []
    for value in _allowed(field):
        if value != getattr(base, field):
            changes = {field: value}
            if field == "kind":  # another family may support other stage counts (fwd_v1: 2 only)
                changes["stages"] = FAMILIES[value].stages[0]
            try:
                others.append(base.replace(**changes).validate())
            except ValueError:
                pass
    assert others, f"no other valid value for {field}"
    for changed in others:
        assert changed.name != base.name, (field, changed)


# ---------------------------------------------------------------- records


@pytest.mark.parametrize("spec", [
    KernelSpec(),
    KernelSpec(arch="sm_80", dtype="fp16", head_dim=32, block_m=16, block_n=16, warps=1, stages=2, causal=True),
    KernelSpec(arch="sm_89", dtype="bf16", head_dim=224, block_m=48, block_n=112, warps=1, stages=4),
    KernelSpec(arch="sm_86", dtype="fp16", head_dim=96, block_m=192, block_n=80, warps=4, stages=3, causal=True),
    KernelSpec(causal=True, window=True, sinks=True),
], ids=lambda s: s.name)
def test_to_dict_from_dict_round_trip(spec):
    """to_dict -> from_dict gives an equal spec with the same name, and the record is plain data: every
    field of the kind, the variant switches only where set."""
    record = spec.to_dict()
    assert set(record) == {f.name for f in fields_of(spec.kind)
                           if f.name not in VARIANT_FIELDS or getattr(spec, f.name)}
    assert all(type(v) in (str, int, bool) for v in record.values())
    again = KernelSpec.from_dict(dict(record))
    assert again == spec
    assert again.name == spec.name
    assert again.to_dict() == record


def test_from_dict_refuses_unknown_fields_and_names_them():
    """An unknown key is a ConfigError naming the key and the file."""
    record = {**KernelSpec().to_dict(), "num_splits": 3}
    with pytest.raises(ConfigError, match="num_splits") as info:
        KernelSpec.from_dict(record, where="configs/h200.yaml")
    assert info.value.path == "configs/h200.yaml"
    assert "configs/h200.yaml" in str(info.value)


@pytest.mark.parametrize("record", [None, [1, 2], "fwd_v2_d128", 7])
def test_from_dict_refuses_non_mappings(record):
    """A record that is not a mapping is a ConfigError, not an AttributeError."""
    with pytest.raises(ConfigError, match="mapping"):
        KernelSpec.from_dict(record)


@pytest.mark.parametrize("field,value", [
    ("head_dim", True),          # bool where an int is meant
    ("block_m", False),
    ("head_dim", "128"),         # number as a string
    ("stages", "2"),
    ("block_n", 64.0),           # float, even an integral one
    ("warps", 4.5),
    ("refill", True),
    ("causal", 1),               # int where a bool is meant
    ("causal", "true"),
    ("dtype", 16),
    ("arch", None),
    ("kind", ["fwd_v2"]),
])
def test_from_dict_refuses_wrong_types(field, value):
    """Field types are exact: no bool-for-int, int-for-bool, str numbers or floats slip through."""
    record = {**KernelSpec().to_dict(), field: value}
    with pytest.raises(ConfigError, match=f"spec field {field} must be (int|bool|str), got"):
        KernelSpec.from_dict(record)


@pytest.mark.parametrize("field,value", [
    ("head_dim", 264), ("head_dim", 0), ("head_dim", -128), ("head_dim", 72), ("head_dim", 12),
    ("block_m", 7), ("block_m", 0), ("block_m", 512),
    ("block_n", 24), ("block_n", -64),
    ("warps", 3), ("warps", 16), ("stages", 1), ("stages", 5), ("refill", 3), ("refill", -1),
    ("dtype", "fp32"), ("dtype", "BF16"), ("arch", "sm_75"), ("arch", "sm_90"), ("kind", "fwd_v3"),
])
def test_from_dict_refuses_out_of_range_and_unknown_enum_values(field, value):
    """Values outside what the templates support are refused with the offending value in the message."""
    record = {**KernelSpec().to_dict(), field: value}
    shown = str(value) if isinstance(value, int) else repr(value)
    with pytest.raises(ConfigError, match=rf"{field}(=| ){re.escape(shown)}(?!\d)"):
        KernelSpec.from_dict(record)


def test_from_dict_refuses_warps_that_do_not_split_block_m():
    """block_m must split into 16-row slices over the warps (48 rows over 2 warps does not)."""
    record = {**KernelSpec().to_dict(), "block_m": 48, "warps": 2}
    with pytest.raises(ConfigError, match="16-row slices"):
        KernelSpec.from_dict(record)


@pytest.mark.parametrize("field,value", [
    ("dtype", "bf16; system(\"rm -rf /\")"),
    ("dtype", "bf16\n#include </etc/passwd>"),
    ("kind", "../../x"),
    ("kind", "fwd_v2/../../etc"),
    ("arch", "sm_90a --extra-device-vectorization"),
    ("arch", "sm_80}} {{ 7*7"),
])
def test_from_dict_refuses_injection_attempts(field, value):
    """Strings that would reach a template, a path or a compiler flag are refused by enum checks."""
    record = {**KernelSpec().to_dict(), field: value}
    with pytest.raises(ConfigError, match=f"{field} {re.escape(repr(value))} not in"):
        KernelSpec.from_dict(record)


# ---------------------------------------------------------------- shared memory and feasibility


def test_smem_bytes_hand_checked():
    """smem = 2 bytes * d * (block_m + 2 * stages * block_n): Q tile plus K and V pipelines.

    d=96, block_m=64, block_n=48, stages=3: 2 * 96 * (64 + 2*3*48) = 2 * 96 * 352 = 67584.
    """
    spec = KernelSpec(arch="sm_80", dtype="fp16", head_dim=96, block_m=64, block_n=48, warps=4, stages=3)
    assert spec.smem_bytes() == 67584
    assert spec.replace(dtype="bf16").smem_bytes() == 67584
    # causal and arch do not change the tiles
    assert spec.replace(causal=True, arch="sm_90a").smem_bytes() == 67584


def test_check_reports_over_budget_shared_memory_on_l4():
    """A d=256 tile that needs 196608 B is refused on the L4 (101376 B per block) with both numbers."""
    spec = KernelSpec(arch="sm_89", dtype="bf16", head_dim=256, block_m=128, block_n=64, warps=8, stages=2)
    l4 = gpus.get("l4")
    assert spec.smem_bytes() == 196608
    reasons = spec.check(l4)
    assert any("196608" in r and "101376" in r and "l4" in r for r in reasons), reasons
    assert not spec.feasible(l4)
    assert spec.check(gpus.get("h200")) == []


def test_check_accepts_a_feasible_spec():
    """A small d=64 tile (40960 B) is feasible on every known GPU."""
    spec = KernelSpec(arch="sm_89", dtype="fp16", head_dim=64, block_m=64, block_n=64, warps=4, stages=2)
    assert spec.smem_bytes() == 40960
    for prof in gpus.PROFILES.values():
        assert spec.check(prof) == [], prof.name
        assert spec.feasible(prof)


def test_check_reports_too_many_accumulators():
    """A tile whose fp32 accumulators per thread exceed the family's limit is reported as likely to spill."""
    spec = KernelSpec(arch="sm_90a", head_dim=256, block_m=128, block_n=128, warps=4, stages=2)
    # 2 slices of 16 rows per warp, (256/8 + 128/8) * 4 floats each = 384 > 200
    assert FWD.acc_floats(spec) == 384
    reasons = spec.check(gpus.get("h200"))
    assert any("384" in r and "spill" in r for r in reasons), reasons


def test_check_returns_reasons_for_an_invalid_spec_instead_of_raising():
    """check() is the enumerator's filter: an invalid spec gives a reason, not an exception."""
    reasons = KernelSpec(head_dim=264).check(gpus.get("h200"))
    assert len(reasons) == 1 and "264" in reasons[0]


@pytest.mark.parametrize("profile", sorted(gpus.PROFILES))
def test_default_rule_only_picks_feasible_specs(profile):
    """Every spec the default rule picks for a profile's arch and budget passes check(profile)."""
    prof = gpus.get(profile)
    keys = [ProblemKey("fwd", prof.arch, dt, d, c, 512)
            for d in HEAD_DIM_TILES for dt in ("fp16", "bf16") for c in (False, True)]
    specs = {families.default_spec(k, prof.smem_per_block) for k in keys}
    assert specs <= set(families.rule_specs(prof.arch, prof.smem_per_block))
    for spec in specs:
        assert spec.arch == prof.arch
        assert spec.check(prof) == [], spec.name


def test_forward_default_family_per_arch():
    """sm_90a takes fwd_sm90 where its tile pads at most a third (64, 96-128, 192-256); fwd_v2 elsewhere."""
    def default(arch, d):
        return families.default_family(ProblemKey("fwd", arch, "bf16", d, False, 512))

    sm90 = [d for d in HEAD_DIM_TILES if default("sm_90a", d) == "fwd_sm90"]
    assert sm90 == [d for d in HEAD_DIM_TILES if d in (64, 96, 128, 192, 224, 256)]
    assert {default(a, d) for a in ("sm_80", "sm_86", "sm_89") for d in HEAD_DIM_TILES} == {"fwd_v2"}
    key = ProblemKey("fwd", "sm_90a", "bf16", 128, True, 4096)
    spec = families.default_spec(key, gpus.get("h200").smem_per_block)
    assert (spec.kind, spec.block_m, spec.block_n, spec.stages, spec.softmax_overlap) == ("fwd_sm90", 192, 80, 3, True)
    spec = families.default_spec(key.replace(variant="win"), gpus.get("h200").smem_per_block)  # a variant's key
    assert (spec.kind, spec.block_m, spec.block_n, spec.stages, spec.softmax_overlap) == ("fwd_sm90", 128, 128, 3, True)


def test_default_rule_raises_when_nothing_fits():
    """No tile fits 1000 B: UnsupportedError naming the head dim, not an empty or oversized spec."""
    key = ProblemKey("fwd", "sm_80", "fp16", 96, False, 512)
    with pytest.raises(UnsupportedError, match="d=96"):
        families.default_spec(key, 1000)


def test_context_carries_name_and_smem():
    """The template context has every field plus the derived name, smem size and param rows."""
    spec = KernelSpec(arch="sm_80", dtype="fp16", head_dim=160, block_m=64, block_n=32, warps=4, stages=2)
    ctx = spec.context()
    for f in fields_of(spec.kind):
        assert ctx[f.name] == getattr(spec, f.name)
    assert "warp_specialized" not in ctx  # another kind's field never reaches this kind's template
    assert ctx["name"] == spec.name
    assert ctx["smem_bytes"] == spec.smem_bytes() == 2 * 160 * (64 + 2 * 2 * 32)
    assert ctx["elem_bytes"] == 2
    assert [n for n, _ in ctx["params"]] == [n for n, _, _ in FWD.params]


def test_context_refuses_an_invalid_spec():
    """No template variables for a spec that fails validation (nothing unchecked reaches Jinja)."""
    with pytest.raises(ValueError, match="dtype"):
        KernelSpec(dtype="bf16; system(1)").context()


# ---------------------------------------------------------------- GPU profiles


def test_gpu_profiles_known_and_case_insensitive():
    """The documented profiles exist; lookup ignores case and surrounding space."""
    for name in ("a100", "h100", "h200", "l4", "rtx4090"):
        assert gpus.get(name).name == name
    assert gpus.get(" H200 ") is gpus.get("h200")
    assert gpus.get("h200").arch == "sm_90a"
    assert gpus.get("a100").smem_per_block == gpus.ARCH_SMEM_PER_BLOCK["sm_80"]


@pytest.mark.parametrize("name", ["b200", "", "h2000", "../h200", None])
def test_gpu_get_refuses_unknown_names(name):
    """An unknown profile is an UnsupportedError that lists the known ones."""
    with pytest.raises(UnsupportedError, match="h200"):
        gpus.get(name)


def test_arch_of_capability():
    """Compute capability maps to the compile target; 9.0 gets the 'a' features; pre-Ampere is refused."""
    assert gpus.arch_of_capability(8, 0) == "sm_80"
    assert gpus.arch_of_capability(8, 9) == "sm_89"
    assert gpus.arch_of_capability(9, 0) == "sm_90a"
    with pytest.raises(UnsupportedError, match="7.5"):
        gpus.arch_of_capability(7, 5)


def test_forced_gpu_profile_from_environment(monkeypatch):
    """FLASHGEN_GPU picks the profile without looking at the hardware."""
    monkeypatch.setenv("FLASHGEN_GPU", "L4")
    assert gpus.detect().name == "l4"
    monkeypatch.setenv("FLASHGEN_GPU", "nonesuch")
    with pytest.raises(UnsupportedError):
        gpus.detect()


# ---------------------------------------------------------------- dispatch


@pytest.mark.parametrize("seqlen,bucket", [
    (1, 512), (37, 512), (512, 512), (513, 1024), (1023, 1024), (2047, 2048), (4097, 8192),
    (16383, 16384), (16384, 16384), (16385, 16384), (1_000_003, 16384),
])
def test_bucket_of(seqlen, bucket):
    """A length maps to the smallest bucket at or above it, and past the last bucket to the last."""
    assert bucket_of(seqlen) == bucket


@pytest.mark.parametrize("d,tile", [
    (8, 32), (24, 32), (32, 32), (40, 64), (64, 64), (72, 96), (104, 128), (136, 160), (168, 192),
    (200, 224), (248, 256), (256, 256),
])
def test_head_dim_tile(d, tile):
    """A head dim maps to the smallest supported tile at or above it."""
    assert head_dim_tile(d) == tile


@pytest.mark.parametrize("d", [264, 512, 12, 7, 0, -8])
def test_head_dim_tile_refuses_unsupported(d):
    """Head dims above 256 or not a positive multiple of 8 are UnsupportedError, naming the value."""
    with pytest.raises(UnsupportedError, match=f"head dim {d}"):
        head_dim_tile(d)


def test_select_without_a_gpu_profile_uses_the_default_rule():
    """With no known GPU, dispatch gives exactly the default rule's spec for the key."""
    key = ProblemKey("fwd", "sm_89", "fp16", head_dim_tile(72), True, bucket_of(999))
    spec = dispatch.select(key, None, gpus.ARCH_SMEM_PER_BLOCK["sm_89"])
    assert spec == families.default_spec(key, gpus.ARCH_SMEM_PER_BLOCK["sm_89"])
    assert (spec.arch, spec.dtype, spec.head_dim, spec.causal) == ("sm_89", "fp16", 96, True)
    assert spec.smem_bytes() <= gpus.ARCH_SMEM_PER_BLOCK["sm_89"]


# ---------------------------------------------------------------- one grammar: names and their parser


def _every_rule_spec():
    return [s for arch in ("sm_80", "sm_90a") for s in families.rule_specs(arch, gpus.ARCH_SMEM_PER_BLOCK[arch])]


def test_from_name_reads_back_every_spec_the_rules_pick():
    """KernelSpec.from_name(spec.name) == spec for every kind's default tiles, Hopper techniques
    and family-only fields included (one grammar, derived from the field metadata)."""
    specs = _every_rule_spec() + [
        KernelSpec.from_name("fwd_sm90_d64_m192_n128_w16_s3_ws_pp_fx1_kr_ls_ps_causal_fp16_sm90a"),
        KernelSpec(kind="decode_split", arch="sm_90a", head_dim=128, block_m=16, block_n=128, warps=4, stages=2,
                   kv_load=5, causal=True).validate(),
        KernelSpec(kind="bwd_sm90", arch="sm_90a", head_dim=64, block_m=64, block_n=128, warps=12, stages=3,
                   dq_write=1).validate()]
    assert {s.kind for s in specs} == set(FAMILIES)
    for spec in specs:
        assert KernelSpec.from_name(spec.name) == spec, spec.name
        assert spec.name.isidentifier()


@pytest.mark.parametrize("name,why", [
    ("fwd_v2_d128_m128_n64_w4_s2_r0_full_bf16_sm90a", "canonical"),          # a default value spelled out
    ("fwd_v2_d128_n64_m128_w4_s2_full_bf16_sm90a", "canonical"),             # tokens out of order
    ("fwd_v2_d128_m128_n64_w4_s2_ws_full_bf16_sm90a", "warp_specialized"),   # another kind's field
    ("fwd_v2_d128_m128_n64_w4_s2_zz3_full_bf16_sm90a", "unknown token"),
    ("fwd_v2_d128_m128_n64_w4_full_bf16_sm90a", "stages"),                   # a common field missing
    ("fwd_v2_d128_m128_n64_w4_s2_s3_full_bf16_sm90a", "twice"),
    ("fwd_v3_d128_m128_n64_w4_s2_full_bf16_sm90a", "fwd_v3"),
    ("fwd_sm90_d128_m128_n128_w12_s2_ws2_full_bf16_sm90a", "takes no number"),
    ("fwd_v2_d128_m128_n64_w4_s2_full_bf16_sm75", "sm_75"),
    ("fwd_v2_d128_m128_n64_w4_s2_full_bf16", "not a kernel name"),
    ("fwd_v2_d128_m128_n64_w4_s2_full_bf16_sm90a; rm -rf /", "not a kernel name"),
])
def test_from_name_refuses_what_no_spec_is_named(name, why):
    with pytest.raises(ValueError, match=why):
        KernelSpec.from_name(name)


def test_family_only_fields_are_absent_from_other_kinds():
    """A field a kind does not use stays at its default, is not in its name or record, and a record or
    a spec that sets it is refused."""
    spec = KernelSpec(head_dim=64, block_m=64, block_n=64, warps=4, stages=2).validate()
    assert "warp_specialized" not in spec.to_dict() and "kv_load" not in spec.to_dict()
    with pytest.raises(ValueError, match="pingpong"):
        spec.replace(pingpong=True).validate()
    with pytest.raises(ConfigError, match="do not belong to fwd_v2"):
        KernelSpec.from_dict({**spec.to_dict(), "dq_write": 0})
    record = spec.to_dict()
    del record["refill"]
    assert KernelSpec.from_dict(record) == spec  # a field left out keeps its default
    with pytest.raises(ConfigError, match="missing field.*refill"):
        KernelSpec.from_dict(record, complete=True)  # (what a tuned table must say: everything)


def test_with_tokens_uses_the_name_grammar():
    base = families.fwd_sm90.variant(128, False, "")
    spec = base.with_tokens("ws_pp_kr_s3")
    assert (spec.warp_specialized, spec.pingpong, spec.early_k_release, spec.stages) == (True, True, True, 3)
    assert base.with_tokens("") == base
    with pytest.raises(ValueError, match="not a name token"):
        base.with_tokens("ws_bogus")
    assert families.fwd_sm90.variant(64, True, "ws_s3_m192").name == "fwd_sm90_d64_m192_n128_w16_s3_ws_causal_bf16_sm90a"


def test_variant_flags_spell_their_tokens_and_round_trip():
    """Each variant switch is a name token after the kind's own (win, cap, alibi, sink, in field order),
    read back by from_name; the problem key's variant uses the same tokens."""
    from flashgen.variants import KEY_TOKENS, Variant

    base = KernelSpec(kind="fwd_v2", arch="sm_90a", dtype="bf16", head_dim=128, block_m=128, block_n=64,
                      warps=4, stages=2, causal=True, refill=1)
    spec = base.replace(window=True, softcap=True, alibi=True, sinks=True).validate()
    assert spec.name == "fwd_v2_d128_m128_n64_w4_s2_r1_win_cap_alibi_sink_causal_bf16_sm90a"
    assert KernelSpec.from_name(spec.name) == spec
    assert {f: KernelSpec.__dataclass_fields__[f].metadata["token"] for f, _ in KEY_TOKENS} == dict(KEY_TOKENS)
    v = Variant.of(False, (4, 0), 30.0, False, True)  # right side 0: the causal kernel's mask
    assert v.causal and v.key() == "win_cap_sink"
    assert base.with_tokens(v.key()) == base.replace(window=True, softcap=True, sinks=True)
    with pytest.raises(ValueError, match="not a field of this kind"):
        KernelSpec(kind="decode_combine", window=True).validate()
