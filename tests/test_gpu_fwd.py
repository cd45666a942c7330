"""GPU tier: the forward through dispatch (fwd_v2; fwd_sm90 where it is the default on sm_90a) against
an fp32 reference on upcast inputs.

Rule (the FlashAttention repository's): flashgen's max error against the fp32
reference must be at most 2x the max error of the same reference computed in
the input dtype, + a rounding-sized atol. Inputs are fresh random normals every time, outputs
are poisoned with NaN first so unwritten elements show, sizes are odd. The
rule's helper, ``check``, is tests/gpu_util.py's (the other GPU modules share it).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU host)"),
]

HEAD_DIMS = [32, 64, 96, 128, 160, 192, 256]

from gpu_util import SEQLENS, check, make_inputs  # noqa: E402  (tests/gpu_util.py: the shared rule)
from flashgen.reference import allowance, reference  # noqa: E402


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("nq,nk", SEQLENS)
def test_matches_reference_bf16(nq, nk, d, causal):
    """Every seqlen pair x head dim x causal, bf16, bhsd, MHA."""
    check(2, 3, 3, nq, nk, d, "bf16", causal)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [40, 64, 128, 256])
@pytest.mark.parametrize("nq,nk", [(113, 203), (1023, 1024), (239, 1), (1, 239)])
def test_fp16_and_odd_head_dim(nq, nk, d, causal, dtype):
    """fp16 as well as bf16; d=40 exercises a head dim rounded up to the tile and masked."""
    check(1, 2, 2, nq, nk, d, dtype, causal)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("group", [1, 2, 6])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(113, 203), (512, 256), (1024, 1023)])
def test_gqa_and_layouts(nq, nk, causal, group, layout):
    """GQA/MQA (6 query heads per KV head, no K/V copies) and the (b, s, h, d) layout via strides."""
    check(2, 6, 6 // group, nq, nk, 128, "bf16", causal, layout)
    check(1, 6, 6 // group, nq, nk, 64, "fp16", causal, layout)


def test_strided_views_no_copy():
    """q, k, v as column slices of one packed qkv tensor (non-contiguous heads) give the right answer."""
    import flashgen

    b, n, h, d = 2, 203, 4, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)  # (b, n, h, d) views with stride 3*h*d along n
    out = flashgen.attention(q, k, v, layout="bshd")
    ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False, d ** -0.5)
    low, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), False, d ** -0.5, torch.bfloat16)
    err = (out.transpose(1, 2).float() - ref).abs().max().item()
    assert err <= allowance(low, ref, torch.bfloat16)


def test_output_poison_and_determinism():
    """Two runs give bitwise equal output; a NaN-poisoned buffer pool shows no unwritten elements."""
    import flashgen

    q, k, v = make_inputs(2, 4, 4, 1023, 1024, 128, torch.bfloat16)
    # Poison: fill and free a large block so the output allocation reuses NaN memory.
    junk = torch.full((2 * 4 * 1023 * 128 * 4,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del junk
    a = flashgen.attention(q, k, v, causal=True)
    b = flashgen.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_large_magnitudes_stay_finite(causal):
    """Inputs scaled x30 (scores in the thousands) stay finite and within the rule."""
    check(1, 2, 2, 1023, 1024, 128, "bf16", causal, magnitude=30.0)
    check(1, 2, 2, 203, 113, 64, "fp16", causal, magnitude=30.0)


def test_fully_masked_rows():
    """Causal with seqlen_q > seqlen_k: the first rows see no key -> output 0 and LSE -inf."""
    out, lse = check(1, 2, 2, 300, 100, 64, "bf16", True)
    assert torch.all(out[:, :, :200] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :200]))
    assert torch.isfinite(lse[:, :, 200:]).all()


def test_empty_key_sequence():
    """seqlen_k = 0: every row sees nothing -> zeros and LSE -inf (no NaN)."""
    import flashgen

    q = torch.randn(1, 2, 17, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flashgen.attention(q, k, k, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_bad_strides_raise_before_launch():
    """A last dimension that is not contiguous, or a misaligned view, is a clear ValueError."""
    import flashgen

    q = torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        flashgen.attention(q[..., ::2], q[..., ::2], q[..., ::2])
    base = torch.randn(1 * 2 * 64 * 64 + 4, device="cuda", dtype=torch.bfloat16)
    mis = base[4:].view(1, 2, 64, 64)  # 8-byte offset: not 16-byte aligned
    with pytest.raises(ValueError, match="aligned"):
        flashgen.attention(mis, mis, mis)
    with pytest.raises(TypeError):
        flashgen.attention(q.float(), q.float(), q.float())
    with pytest.raises(flashgen.UnsupportedError):
        x = torch.randn(1, 2, 64, 12, device="cuda", dtype=torch.bfloat16)
        flashgen.attention(x, x, x)


def test_works_on_side_stream_and_in_cuda_graph():
    """Launches go on torch's current stream, so a CUDA graph captures and replays them."""
    import flashgen

    q, k, v = make_inputs(1, 4, 4, 256, 256, 64, torch.bfloat16)
    out = flashgen.attention(q, k, v, causal=True)  # compile + load outside the capture
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g):
            static_out = flashgen.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        expect = flashgen.attention(q, k, v, causal=True)
        assert torch.equal(static_out, expect)
    assert not torch.equal(static_out, out)


def test_kernel_loaded_before_torch_touches_the_device():
    """A kernel loaded before torch has initialised CUDA (a warm-up, a precompile step) still launches
    afterwards: the loader keeps the primary context it loaded into alive (releasing it destroyed the
    context, and the launch failed with CUDA_ERROR_INVALID_HANDLE)."""
    import subprocess
    import sys

    code = (
        "import torch, flashgen\n"
        "from flashgen.codegen import load\n"
        "from flashgen.families import fwd_v2\n"
        "from flashgen.problem import ProblemKey\n"
        "from flashgen import dispatch\n"
        "arch = 'sm_90a' if torch.cuda.get_device_capability() == (9, 0) else 'sm_80'\n"
        "spec = fwd_v2.FAMILY.rule(ProblemKey('fwd', arch, 'bf16', 64, False, 512), 99 * 1024)[0]\n"
        "load(spec, 0)\n"
        "q = torch.randn(1, 2, 64, 64, device='cuda', dtype=torch.bfloat16)\n"
        "out = flashgen.attention(q, q, q, spec=spec)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, q, q)\n"
        "assert (out - ref).abs().max().item() < 0.05\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_first_call_in_a_new_thread():
    """A thread whose first CUDA call is flashgen's (a worker, the autograd engine's) has no current context:
    the launch paths make torch's primary context current there first (the tensor maps and launches failed
    with CUDA_ERROR_INVALID_CONTEXT otherwise). Forward, decode and a backward whose first op is
    flashgen's, each in a fresh thread of a new process."""
    import subprocess
    import sys

    code = (
        "import threading, torch, flashgen\n"
        "q, k, v = (torch.randn(2, 4, 200, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)"
        " for _ in range(3))\n"
        "kc = torch.randn(2, 300, 4, 128, device='cuda', dtype=torch.bfloat16)\n"
        "qd = torch.randn(2, 1, 4, 128, device='cuda', dtype=torch.bfloat16)\n"
        "lens = torch.full((2,), 300, device='cuda', dtype=torch.int32)\n"
        "torch.cuda.synchronize()\n"
        "got = {}\n"
        "def work():\n"
        "    with torch.no_grad():\n"
        "        got['fwd'] = flashgen.attention(q, k, v, causal=True)\n"
        "        got['dec'] = flashgen.decode(qd, kc, kc, lens)\n"
        "    out = flashgen.attention(q, k, v, causal=True)\n"
        "    out.backward(torch.ones_like(out))\n"
        "    torch.cuda.synchronize()\n"
        "t = threading.Thread(target=work); t.start(); t.join()\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "assert (got['fwd'] - ref).abs().max().item() < 0.05, 'forward'\n"
        "assert torch.isfinite(got['dec']).all() and q.grad is not None and torch.isfinite(q.grad).all()\n"
        "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
