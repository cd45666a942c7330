"""Storage-less tensors that report a CUDA device (torch's FakeTensorMode), for the CPU tests of the torch
layer's checks: an entry point sees a CUDA tensor of the right shape, dtype and strides, and no GPU is
needed. Imported by the test modules after their ``pytest.importorskip("torch")``."""
from __future__ import annotations

import warnings

import pytest
import torch


def fake(*shape, dtype=torch.bfloat16, device="cuda", strides=None):
    """A storage-less tensor of ``shape`` and ``dtype`` (with ``strides``: those element strides) that
    reports ``device``; skips the test where this torch build has no FakeTensorMode."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover -- depends on the torch build
        pytest.skip("torch has no FakeTensorMode: cannot make CUDA-device tensors without a GPU")
    with FakeTensorMode():
        if strides is not None:
            return torch.empty_strided(shape, strides, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)


def decode_quietly(*args, **kwargs):
    """``flashgen.decode`` on fake tensors with its warnings silenced (the checks under test raise first)."""
    import flashgen

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flashgen.decode(*args, **kwargs)
