# Compare cubins of default specs between two checkouts: python3 compare_cubins_vs_commit.py <repo> list|old|new
# (run "list" with the newer repo, then "old"/"new" with each checkout; results in /tmp/cmp_*.json).
import sys, json, hashlib
sys.path.insert(0, sys.argv[1])
from flashgen import dispatch, decoding, gpus
from flashgen.spec import KernelSpec
from flashgen.codegen import render
from flashgen.codegen.compiler import compile_source
from multiprocessing.pool import ThreadPool
mode = sys.argv[2]
if mode == "list":
    out = []
    for arch in ("sm_90a",):
        b = gpus.ARCH_SMEM_PER_BLOCK[arch]
        for kind in ("fwd_v1", "standard_qk", "standard_softmax", "standard_pv", "fwd_sm90"):
            out += [s.to_dict() for s in dispatch.default_specs(arch, b, kind)]
        out += [s.to_dict() for s in decoding.default_specs(arch, b)]
    json.dump(out, open("/tmp/cmp_list.json", "w"))
    print(len(out), "specs")
else:
    specs = json.load(open("/tmp/cmp_list.json"))
    def one(d):
        fields = {f for f in KernelSpec.__dataclass_fields__}
        s = KernelSpec(**{k: v for k, v in d.items() if k in fields})
        b = compile_source(render(s), s.arch, s.name)
        return s.name, hashlib.sha256(b.cubin).hexdigest(), (b.report.registers, b.report.spill_stores)
    with ThreadPool(2) as p:
        res = p.map(one, specs)
    json.dump(res, open(f"/tmp/cmp_{mode}.json", "w"))
    print(len(res), "compiled")
