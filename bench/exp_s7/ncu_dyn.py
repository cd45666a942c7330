# Session 7 experiment: one decode call at b1/hk32/L32k with e709bc9's kernel (the reverted KernelSpec.dynamic
# and its FG_DYN_VARIANT hooks), the default tile static (argv[1] = "static") or dynamic with FG_DYN_VARIANT =
# argv[1] (0: counter order, 1: interleaved, no counter). Needs that commit's package beside this file:
#   git archive e709bc9 flashgen | tar -x -C bench/exp_s7/tree      (then: OUT=... bash bench/exp_s7/run.sh)
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tree"))
import torch  # noqa: E402

import flashgen  # noqa: E402
import flashgen.codegen as codegen  # noqa: E402
from flashgen import decode_api  # noqa: E402

assert "exp_s7" in flashgen.__file__, flashgen.__file__
arg = sys.argv[1]
if arg != "static":
    plain = codegen.render
    codegen.render = lambda spec: (f"#define FG_DYN_VARIANT {arg}\n" + plain(spec)) if spec.kind == "decode_split" \
        else plain(spec)
b, hq, hk, L, d = 1, 32, 32, 32768, 128
q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn(b, hk, L, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
flashgen.decode(q, k, v, lens, check_values=False)
spec = next(p for p in decode_api._plans.values() if p.kernel is not None).spec
if arg != "static":
    spec = spec.replace(dynamic=True).validate()
for _ in range(3):
    flashgen.decode(q, k, v, lens, check_values=False, spec=spec)
torch.cuda.synchronize()
print(spec.name)
