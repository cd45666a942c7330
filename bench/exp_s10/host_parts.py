"""Session 10: where flashgen.decode's per-call host time goes (cached plan and kernel), part by part, on
the device's host. Each part is timed in bursts of calls without a sync, best of rounds (bench.timing.host_us),
next to the whole call and to a bare torch.empty as the host's speed unit.

    python3 bench/exp_s10/host_parts.py [OUT.json]
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import torch  # noqa: E402

import flashgen  # noqa: E402
from flashgen.bench import timing  # noqa: E402
from flashgen import decode_api  # noqa: E402
from flashgen.api import _current_device, _current_stream, _is_capturing  # noqa: E402

D = 128


def main(out=None):
    q = torch.randn(1, 1, 32, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 512, 8, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((1,), 512, dtype=torch.int32, device="cuda")
    flashgen.decode(q, k, k, lens, check_values=False)
    plan = next(p for p in reversed(list(decode_api._plans.values())) if p.kernel is not None)
    stream = _current_stream(0)
    dev = q.device
    # a complete parameter block, filled as decode_api.decode and _launch fill it
    out0 = torch.empty(q.shape, dtype=q.dtype, device=dev)
    params = plan.params()
    params.q, params.k, params.v, params.o = q.data_ptr(), k.data_ptr(), k.data_ptr(), out0.data_ptr()
    params.seqlens, params.lse = lens.data_ptr(), 0
    if plan.splits > 1:
        assert plan.combine is None, "the fused merge is the default"
        ws, ctr = decode_api._workspace(plan, stream)
        params.o_ws = ws.data_ptr()
        params.lse_ws = ws.data_ptr() + plan.ws_lse_offset
        params.counters = ctr.data_ptr()

    def sig():
        return (q.shape, q.stride(), q.dtype, q.get_device(), k.shape, k.stride(), k.dtype, k.get_device(),
                k.shape, k.stride(), k.dtype, k.get_device(), decode_api._tsig(lens), None, None,
                None, None, False, False, None, type(None), type(None), bool, bool)

    parts = {
        "noop": lambda: None,
        "torch_empty_1": lambda: torch.empty(1, device=dev),
        "sig": sig,
        "sig+get": lambda: decode_api._plans.get(sig()),
        "data_ptr_x3": lambda: (q.data_ptr(), k.data_ptr(), k.data_ptr()),
        "out_empty": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "out_new_empty": lambda: q.new_empty(q.shape),
        "params": plan.params,
        "workspace": lambda: decode_api._workspace(plan, stream),
        "stream+device": lambda: (_current_device(), _current_stream(0)),
        "capturing": _is_capturing,
        "launch": lambda: plan.kernel.launch(plan.grid, params, stream),
        "decode": lambda: flashgen.decode(q, k, k, lens, check_values=False),
    }
    res = {}
    for name, fn in parts.items():
        fn()
        res[name] = timing.host_us(fn, 200, 20)
    torch.cuda.synchronize()
    import cProfile
    import pstats
    import io
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        flashgen.decode(q, k, k, lens, check_values=False)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-3000:])
    for name, us in res.items():
        print(f"{name:<16} {us:7.2f} us")
    if out:
        Path(out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
