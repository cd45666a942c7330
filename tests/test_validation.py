"""flashgen.attention input validation, without a GPU.

attention() checks, in order: tensor types, layout, causal, then per tensor
rank, device and dtype, then one device, one dtype, shapes, GQA heads, head
dim, grid limits, strides/alignment, softmax_scale, return_lse. Everything
raises before dispatch or any launch.

Two kinds of inputs reach those checks here:
- CPU and meta tensors: real tensors that are not on a CUDA device; they reach
  the type/layout/causal/rank/device checks.
- "fake CUDA" tensors (torch's FakeTensorMode): shape, dtype and strides on a
  "cuda" device with no storage and no GPU; they pass the device check and
  reach the dtype, shape, head-dim, softmax_scale and return_lse checks. They
  are not a stand-in for real data (alignment is not meaningful for them), so
  stride and alignment rules are left to the GPU tests.

Every error case matches the expected message, so it proves that check fired
(on a CPU-only torch, getting past validation fails differently: no CUDA). The
autouse guard below also fails a test that reaches dispatch or kernel loading.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

import flashgen
import flashgen.api.forward
import flashgen.codegen
import flashgen.dispatch
from flashgen import UnsupportedError, testing
from flashgen.api.checks import check_attention_inputs
from fake_util import fake as fake_tensor

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Fail the test if attention() gets past validation to dispatch or to loading a kernel."""
    def reached(*args, **kwargs):
        raise AssertionError("validation let the call through to dispatch/launch")

    monkeypatch.setattr(flashgen.dispatch, "select", reached)
    monkeypatch.setattr(flashgen.codegen, "load", reached)
    monkeypatch.setattr(flashgen.api.forward, "load", reached)


def cpu(*shape, dtype=F16):
    return torch.randn(*shape).to(dtype)


def meta(*shape, dtype=F16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def fake(*shape, dtype=F16, device="cuda"):
    """A storage-less tensor that reports a CUDA device (no GPU needed)."""
    return fake_tensor(*shape, dtype=dtype, device=device)


def _fake_data_ptr_works() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fake(1, 1, 8, 8).data_ptr()
            return True
        except Exception:  # noqa: BLE001 -- any failure means the stride checks are out of reach
            return False


def attention(*args, **kwargs):
    # data_ptr() of a fake tensor warns (deprecated); that is the point we test past, not a problem.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        return flashgen.attention(*args, **kwargs)


# ---------------------------------------------------------------- CPU and meta tensors


@pytest.mark.parametrize("dtype", [F16, BF16, torch.float32])
def test_cpu_tensors_are_refused(dtype):
    """CPU tensors of any dtype raise ValueError naming the device, before anything else happens."""
    q = cpu(3, 5, 37, 64, dtype=dtype)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        attention(q, q, q)


def test_cpu_key_with_cuda_query_is_refused():
    """A CPU k next to a CUDA q is refused by name (k), not launched on a host pointer."""
    q = fake(3, 5, 37, 64)
    k = cpu(3, 5, 37, 64)
    with pytest.raises(ValueError, match="k must be a CUDA tensor, got device cpu"):
        attention(q, k, fake(3, 5, 37, 64))


@pytest.mark.parametrize("bad", [None, [[1.0]], 3.0, "q"])
def test_non_tensors_are_refused(bad):
    """Anything but a torch.Tensor is a TypeError naming the argument and the type."""
    k = cpu(1, 3, 17, 32)
    with pytest.raises(TypeError, match=f"v must be a torch.Tensor, got {type(bad).__name__}"):
        attention(k, k, bad)


@pytest.mark.parametrize("shape", [(5, 37, 64), (37, 64), (1, 3, 5, 37, 64)])
def test_wrong_rank_is_refused(shape):
    """q of rank other than 4 is a ValueError showing the shape."""
    q = meta(*shape)
    with pytest.raises(ValueError, match=re.escape(f"q must be 4-D (bhsd), got shape {tuple(shape)}")):
        attention(q, q, q)


@pytest.mark.parametrize("layout", ["bshd ", "BHSD", "bsh", "", None, 0])
def test_bad_layout_is_refused(layout):
    """Only 'bhsd' and 'bshd' are layouts; anything else is a ValueError showing it."""
    q = cpu(3, 5, 37, 64)
    with pytest.raises(ValueError, match="layout must be one of"):
        attention(q, q, q, layout=layout)


@pytest.mark.parametrize("causal", [1, 0, "yes", None, torch.tensor(True)])
def test_causal_must_be_a_bool(causal):
    """causal is a real bool; truthy stand-ins are a TypeError, not silently read as a mask choice."""
    q = cpu(3, 5, 37, 64)
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(q, q, q, causal=causal)


# ---------------------------------------------------------------- fake CUDA tensors


def test_fp32_is_refused():
    """fp32 on a CUDA device is a TypeError naming the dtype (the kernels take fp16/bf16)."""
    q = fake(3, 5, 37, 72, dtype=torch.float32)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got torch.float32"):
        attention(q, q, q)


@pytest.mark.parametrize("dtypes,message", [
    ((F16, BF16, F16), "q, k, v must have one dtype, got torch.float16, torch.bfloat16, torch.float16"),
    ((BF16, BF16, F16), "q, k, v must have one dtype, got torch.bfloat16, torch.bfloat16, torch.float16"),
    ((F16, F16, torch.float64), "v must be float16 or bfloat16, got torch.float64"),
])
def test_mixed_dtypes_are_refused(dtypes, message):
    """q, k, v of different dtypes are a TypeError listing them (a non-16-bit one is named first)."""
    q, k, v = (fake(3, 5, 37, 72, dtype=dt) for dt in dtypes)
    with pytest.raises(TypeError, match=re.escape(message)):
        attention(q, k, v)


def test_two_devices_are_refused():
    """q on cuda:0 and k, v on cuda:1 are a ValueError listing the devices."""
    q = fake(3, 5, 37, 72, device="cuda:0")
    k = fake(3, 5, 37, 72, device="cuda:1")
    with pytest.raises(ValueError, match="one device, got cuda:0, cuda:1"):
        attention(q, k, k)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_k_and_v_shapes_must_match(layout):
    """k and v of different key lengths are a ValueError showing both shapes."""
    q = fake(3, 5, 37, 40)
    k, v = fake(3, 5, 129, 40), fake(3, 5, 127, 40)
    if layout == "bshd":
        q, k, v = fake(3, 37, 5, 40), fake(3, 129, 5, 40), fake(3, 127, 5, 40)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        attention(q, k, v, layout=layout)


def test_batch_must_match():
    """q and k of different batch sizes are a ValueError naming both."""
    q, k = fake(3, 5, 37, 40), fake(2, 5, 37, 40)
    with pytest.raises(ValueError, match="one batch size, got 3 and 2"):
        attention(q, k, k)


def test_head_dim_must_match():
    """q and k of different head dims are a ValueError naming both."""
    q, k = fake(3, 5, 37, 40), fake(3, 5, 37, 48)
    with pytest.raises(ValueError, match="one head dim, got 40 and 48"):
        attention(q, k, k)


def test_bshd_layout_reads_heads_from_dim_2():
    """In 'bshd' the heads are dimension 2: 37 query 'heads' over 5 kv heads is refused as GQA, while
    the same tensors read as 'bhsd' pass the shape checks (they fail later, on softmax_scale)."""
    q, k = fake(3, 5, 37, 40), fake(3, 5, 5, 40)
    with pytest.raises(ValueError, match=r"heads of q \(37\) must be a multiple of heads of k/v \(5\)"):
        attention(q, k, k, layout="bshd")
    if not _fake_data_ptr_works():
        pytest.skip("fake tensors have no data_ptr in this torch: the later checks are out of reach")
    with pytest.raises(ValueError, match="softmax_scale"):
        attention(q, k, k, layout="bhsd", softmax_scale=-1.0)


@pytest.mark.parametrize("hq,hk", [(6, 4), (7, 2), (5, 3), (3, 0)])
def test_query_heads_must_be_a_multiple_of_kv_heads(hq, hk):
    """GQA/MQA: heads of q must be a multiple of heads of k/v (and k/v need at least one head)."""
    q, k = fake(3, hq, 37, 40), fake(3, hk, 61, 40)
    with pytest.raises(ValueError, match=rf"heads of q \({hq}\) must be a multiple of heads of k/v \({hk}\)"):
        attention(q, k, k)


@pytest.mark.parametrize("d", [12, 4, 100, 264, 512])
def test_unsupported_head_dims(d):
    """Head dims that are not multiples of 8 from 8 to 256 are UnsupportedError naming the head dim."""
    q = fake(3, 5, 37, d)
    with pytest.raises(UnsupportedError, match=f"head dim {d} is not supported"):
        attention(q, q, q)


@pytest.mark.parametrize("scale,exc", [
    (0, ValueError), (0.0, ValueError), (-1, ValueError), (-0.125, ValueError), (math.nan, ValueError),
    (math.inf, ValueError), (-math.inf, ValueError),
    ("x", TypeError), ("0.125", TypeError), (True, TypeError), (False, TypeError), ([0.1], TypeError),
    (complex(0.1, 0), TypeError),
])
def test_bad_softmax_scale(scale, exc):
    """softmax_scale must be a finite positive real number; bools and strings are TypeError."""
    if not _fake_data_ptr_works():
        pytest.skip("fake tensors have no data_ptr in this torch: softmax_scale is checked after alignment")
    q, k = fake(3, 5, 37, 72), fake(3, 5, 129, 72)
    with pytest.raises(exc, match="softmax_scale"):
        attention(q, k, k, softmax_scale=scale)


def test_check_inputs_accepts_valid_fake_inputs_and_computes_the_scale():
    """Valid odd-sized GQA inputs pass validation with the default scale 1/sqrt(d) and the strides of
    the chosen layout (no launch happens: check_attention_inputs only checks)."""
    if not _fake_data_ptr_works():
        pytest.skip("fake tensors have no data_ptr in this torch")
    q, k = fake(3, 6, 37, 72), fake(3, 2, 129, 72)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dims, sq, (hk, nk), sk, sv, scale = check_attention_inputs(q, k, k, True, None, "bhsd")
    assert dims == (3, 6, 37, 72) and (hk, nk) == (2, 129)
    assert sq == (6 * 37 * 72, 37 * 72, 72) and sk == sv == (2 * 129 * 72, 129 * 72, 72)
    assert scale == pytest.approx(1 / math.sqrt(72))


def test_return_lse_must_be_a_bool():
    """return_lse is a real bool: 1 or "yes" is a TypeError, raised before any device work."""
    if not _fake_data_ptr_works():
        pytest.skip("fake tensors have no data_ptr in this torch: return_lse is checked after alignment")
    q, k = fake(3, 5, 37, 72), fake(3, 5, 129, 72)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            attention(q, k, k, return_lse=bad)


@pytest.mark.parametrize("first,second,message", [
    ({"causal": True}, {"causal": 1}, "causal must be a bool"),
    ({"softmax_scale": 1.0}, {"softmax_scale": True}, "softmax_scale must be a real number"),
    ({"return_lse": False}, {"return_lse": 0}, "return_lse must be a bool"),
], ids=["causal", "softmax_scale", "return_lse"])
def test_cached_plan_does_not_skip_type_checks(monkeypatch, first, second, message):
    """A call whose shapes were planned before must still refuse a wrongly typed flag.

    The first call has an empty query, so planning needs no GPU; on a CPU-only torch it then fails
    allocating the (empty) output on CUDA, after the plan is cached.
    """
    if not _fake_data_ptr_works():
        pytest.skip("fake tensors have no data_ptr in this torch")
    testing.plans("attention").clear()  # no plan of an earlier test answers for this one
    q, k = fake(3, 5, 0, 72), fake(3, 5, 37, 72)
    try:
        attention(q, k, k, **first)
    except (TypeError, ValueError, UnsupportedError):
        raise  # the first call is valid: validation must accept it
    except Exception:  # noqa: BLE001 -- no CUDA to allocate the output: expected without a GPU
        pass
    try:
        attention(q, k, k, **second)
    except Exception as exc:  # noqa: BLE001 -- inspected below
        error = exc
    else:
        error = None
    assert isinstance(error, TypeError) and message in str(error), f"expected TypeError({message!r}), got {error!r}"
