"""What one trial does to a spec: compile, check, time (or model).

A trial's ``Outcome`` has a status:

- ``ok``: a time (ms), measured or modelled;
- ``constraint``: refused before any launch (the ptxas report shows spills, a
  stack frame or too many registers; or the spec is statically infeasible);
- ``compile_error``, ``launch_error``: the reason is the exception's message;
- ``wrong``: it ran but broke the correctness rule (never a winner).

``MeasuredObjective`` runs on the GPU; its build, check and timer are
parameters so the logic is tested on a CPU with fakes. ``ModelObjective``
needs no GPU: it compiles for the target arch and asks the cost model.

A forward key's trial checks and times ``flashgen.attention`` with the spec
forced; a backward key's (``space.is_backward``) checks and times the whole
``flashgen.api.backward.attention_backward`` (preprocess, dK/dV, dQ kernel or
convert) in the key's dQ mode (``space.BWD_KEY_MODES``) with the spec forced for
its kind and dispatch's picks for the other kernels, on the output and LSE of
the default forward.
"""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

from ..bench.timing import time_ms
from ..codegen import build
from ..errors import CompileError
from ..reference import allowance, grad_tolerance, reference, tolerance
from .. import mods, variants
from . import cost, space

STATUSES = ("ok", "constraint", "compile_error", "launch_error", "wrong")

# User mods a tune measures (``flashgen tune --score-mod/--mask-mod``): their pair's token -> (score_mod,
# mask_mod), the functions the trials' calls pass (the kernels take the traced graphs, the call the functions).
MOD_FUNCTIONS: dict = {}


def mod_kwargs(token: int, reference_side: bool = False) -> dict:
    """``flashgen.attention``'s score_mod / mask_mod keywords for a mod spec's trials; ``reference_side``: the
    traced graphs' evaluators instead (the printed code's semantics, indices clamped into the captures, so
    that the check's odd sizes read them as the kernel does)."""
    score_fn, mask_fn = MOD_FUNCTIONS[token]
    if not reference_side:
        return {k: f for k, f in (("score_mod", score_fn), ("mask_mod", mask_fn)) if f is not None}
    pair = mods.of_number(token)
    out = {}
    if pair.score is not None:
        out["score_mod"] = pair.score.evaluate
    if pair.mask is not None:
        out["mask_mod"] = lambda b, h, q, kv: pair.mask.evaluate(None, b, h, q, kv)
    return out


@dataclass
class Outcome:
    status: str
    time_ms: float | None = None
    reason: str = ""
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown trial status {self.status!r}")
        if self.status == "ok" and not (isinstance(self.time_ms, float) and math.isfinite(self.time_ms)
                                        and self.time_ms > 0):
            raise ValueError(f"an ok trial needs a positive finite time, got {self.time_ms!r}")


def _default_build(spec):
    return build(spec)


def compile_outcome(spec, build=_default_build):
    """(binary, None) when ``spec`` compiles to a usable binary, else (None, failed Outcome)."""
    try:
        binary = build(spec)
    except CompileError as exc:
        return None, Outcome("compile_error", reason=str(exc).splitlines()[0][:300])
    problems = binary.report.problems()
    if problems:
        return None, Outcome("constraint", reason="; ".join(problems),
                             info={"registers": binary.report.registers})
    return binary, None


class ModelObjective:
    """Rank by the cost model: compile for the target arch, estimate from the ptxas report."""

    source = "model"

    def __init__(self, profile, build=_default_build):
        self.profile = profile
        self.build = build
        self.shapes: dict = {}  # ProblemKey -> recorded shape (tune --from); others at problem_shape

    def __call__(self, key, spec) -> Outcome:
        binary, failed = compile_outcome(spec, self.build)
        if failed:
            return failed
        regs = binary.report.registers
        est = cost.estimate(spec, model_shape(key, self.shapes), self.profile, regs)
        if not math.isfinite(est):
            return Outcome("constraint", reason="no CTA fits on an SM", info={"registers": regs})
        return Outcome("ok", est * 1e3, info={"registers": regs, "model_ms": est * 1e3})


def model_shape(key, shapes=None) -> tuple:
    """(batch, heads, seqlen, d) the cost model estimates ``key`` at: the query side of
    ``space.measured_shape`` (the model takes seqlen_k = seqlen_q)."""
    b, h, _, nq, _, d = space.measured_shape(key, shapes)
    return (b, h, nq, d)


# The screening timer of one trial (``bench.timing.time_ms``): a short budget per trial; the calls queued ahead
# of the GPU (``ahead``), so a recorded key whose call is shorter than its host work (a decode step through
# the forward, a short prefill) is ranked by its kernels' time, not by the host's, which every tile shares.
TIMING = {"budget_s": 0.05, "min_reps": 5, "max_reps": 30, "warmup": 2, "ahead": True}


def median_ms(fn) -> float:
    """Median time of ``fn`` in ms from CUDA events: a short budget per trial (the shared timer)."""
    return time_ms(fn, **TIMING)["ms"]


def timing_calls(ms: float) -> int:
    """How many calls ``median_ms`` makes of a function that takes ``ms`` (warm-up, probe, reps)."""
    reps = int(min(TIMING["max_reps"], max(TIMING["min_reps"], TIMING["budget_s"] * 1e3 / max(ms, 1e-3))))
    return TIMING["warmup"] + 1 + reps


class MeasuredObjective:
    """Compile, check against the fp32 reference (once per spec), time at the key's shape."""

    source = "measured"

    def __init__(self, profile, device_index: int = 0, build=_default_build, check=None, timer=None):
        self.profile = profile
        self.device_index = device_index
        self.device = f"cuda:{device_index}"  # where inputs are made (tests on a CPU set another)
        self.build = build
        self.check = check or self._check_on_gpu
        self.timer = timer or self._time_on_gpu
        self._checked: dict = {}
        self._inputs: dict = {}
        self.shapes: dict = {}  # ProblemKey -> recorded shape (tune --from); others at problem_shape

    def __call__(self, key, spec) -> Outcome:
        binary, failed = compile_outcome(spec, self.build)
        if failed:
            return failed
        regs = binary.report.registers
        info = {"registers": regs,
                "model_ms": cost.estimate(spec, model_shape(key, self.shapes), self.profile, regs) * 1e3}
        try:
            verdict = self._checked.get(spec)
            if verdict is None:
                verdict = self._checked[spec] = self.check(spec)
            if verdict:
                return Outcome("wrong", reason=verdict, info=info)
            ms = float(self.timer(key, spec))
        except CompileError as exc:
            return Outcome("compile_error", reason=str(exc)[:300], info=info)
        except Exception as exc:  # a launch failure is a failed trial, not the end of the run
            return Outcome("launch_error", reason=f"{type(exc).__name__}: {str(exc)[:300]}", info=info)
        if not (math.isfinite(ms) and ms > 0):
            return Outcome("launch_error", reason=f"timer returned {ms!r}", info=info)
        return Outcome("ok", ms, info=info)

    def confirm(self, key, specs, rounds: int = 3) -> dict:
        """Re-time ``specs`` (already passed) in interleaved rounds; spec -> median of the rounds, ms.

        Screening times each candidate once with a short budget, so the top few can
        swap places by noise (1-2 % on the H200); timing the finalists against each
        other, interleaved so drift hits all alike, decides between them.
        """
        times: dict = {s: [] for s in specs}
        for _ in range(rounds):
            for s in specs:
                times[s].append(float(self.timer(key, s)))
        return {s: statistics.median(v) for s, v in times.items()}

    # -- the GPU side -------------------------------------------------------
    def _check_on_gpu(self, spec) -> str:
        """'' when ``spec`` meets the 2x rule on fresh random odd-sized inputs, else why not."""
        import torch

        from ..api import attention

        if space.is_backward(spec.kind):
            return self._check_backward(spec)
        if getattr(spec, "varlen", False):
            return self._check_varlen(spec)
        if getattr(spec, "fp8", False):
            return self._check_fp8(spec)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        dev = self.device
        d = spec.head_dim - 8 if spec.head_dim > 32 else spec.head_dim  # a masked head-dim tail too
        for nq, nk in ((203, 317), (317, 203), (1, 77)):
            q = torch.randn(2, 4, nq, d, device=dev, dtype=dtype)
            k, v = (torch.randn(2, 2, nk, d, device=dev, dtype=dtype) for _ in range(2))
            kw = variants.tuning_kwargs(variants.spec_key(spec), spec.causal, max(nq, nk), 4, dev)
            out = attention(q, k, v, causal=spec.causal, spec=spec, **kw, **(mod_kwargs(spec.mod) if spec.mod else {}))
            if spec.mod:
                kw = mod_kwargs(spec.mod, reference_side=True)
            ref, tol = tolerance(q, k, v, spec.causal, d ** -0.5, **kw)
            err = (out.float() - ref).abs().max().item()
            if not err <= tol:  # NaN fails too
                return f"max error {err:.3e} > {tol:.3e} at nq={nq}, nk={nk}, d={d}"
        return ""

    def _check_fp8(self, spec) -> str:
        """'' when an FP8 call with ``spec`` forced meets the rule against the P-in-e4m3 emulation (the GPU
        tier's, tests/test_gpu_fp8.py) on fresh random odd-sized GQA inputs quantized per head, else why not."""
        import torch

        from ..api import attention
        from ..api.fp8 import dequantize_fp8, quantize_fp8

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        dev = self.device
        d = spec.head_dim - 16 if spec.head_dim > 32 else spec.head_dim  # a masked head-dim tail too
        for nq, nk in ((203, 317), (317, 203), (1, 77)):
            (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(torch.randn(2, h, n, d, device=dev))
                                            for h, n in ((4, nq), (2, nk), (2, nk)))
            kw = variants.tuning_kwargs(variants.spec_key(spec), spec.causal, max(nq, nk), 4, dev)
            out = attention(q8, k8, v8, causal=spec.causal, spec=spec, q_descale=qd, k_descale=kd, v_descale=vd,
                            out_dtype=dtype, **kw)
            qf, kf, vf = (dequantize_fp8(x, ds) for x, ds in ((q8, qd), (k8, kd), (v8, vd)))
            ref, _ = reference(qf, kf, vf, spec.causal, d ** -0.5, **kw)
            emu, _ = reference(qf, kf, vf, spec.causal, d ** -0.5, p_fp8=True, **kw)
            err, tol = (out.float() - ref).abs().max().item(), allowance(emu.to(dtype), ref, dtype)
            if not err <= tol:  # NaN fails too
                return f"max error {err:.3e} > {tol:.3e} at nq={nq}, nk={nk}, d={d} (fp8)"
        return ""

    def _check_varlen(self, spec) -> str:
        """'' when a packed-rows call with ``spec`` forced meets the 2x rule sequence by sequence on fresh
        random odd lengths (one of them 0, GQA), else why not."""
        import torch

        from ..api import attention_varlen

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        dev, h, hk = self.device, 4, 2
        d = spec.head_dim - 8 if spec.head_dim > 32 else spec.head_dim
        q_lens, k_lens = (203, 1, 0, 317), (317, 77, 5, 203)
        q = torch.randn(sum(q_lens), h, d, device=dev, dtype=dtype)
        k, v = (torch.randn(sum(k_lens), hk, d, device=dev, dtype=dtype) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], device=dev, dtype=torch.int32)
                      for n in (q_lens, k_lens))
        kw = variants.tuning_kwargs(variants.spec_key(spec), spec.causal, max(k_lens), h, dev)
        out = attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), spec.causal, spec=spec, **kw)
        for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
            if not nq:
                continue
            rows, keys = slice(int(cu_q[s]), int(cu_q[s]) + nq), slice(int(cu_k[s]), int(cu_k[s]) + nk)
            bhsd = [t[idx].transpose(0, 1).unsqueeze(0) for t, idx in ((q, rows), (k, keys), (v, keys))]
            ref, tol = tolerance(*bhsd, spec.causal, d ** -0.5, **kw)
            err = (out[rows].transpose(0, 1).unsqueeze(0).float() - ref).abs().max().item()
            if not err <= tol:  # NaN fails too
                return f"max error {err:.3e} > {tol:.3e} at sequence {s} (nq={nq}, nk={nk}), d={d}"
        return ""

    def _check_backward(self, spec) -> str:
        """'' when a backward run with ``spec`` forced meets the gradient rule (``grad_tolerance``: 3x)
        on fresh random odd-sized GQA inputs, else why not."""
        import torch

        from ..api import attention, attention_backward

        kind = space.problem_of(spec.kind)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
        dev = self.device
        d = spec.head_dim - 8 if spec.head_dim > 32 else spec.head_dim  # a masked head-dim tail too
        for nq, nk in ((203, 317), (317, 203), (1, 77)):
            q, dout = (torch.randn(2, 4, nq, d, device=dev, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(2, 2, nk, d, device=dev, dtype=dtype) for _ in range(2))
            out, lse = attention(q, k, v, causal=spec.causal, return_lse=True)
            grads = attention_backward(dout, q, k, v, out, lse, spec.causal, d ** -0.5,
                                       dq_mode=space.BWD_KEY_MODES[kind], specs={kind: spec})
            refs, tols = grad_tolerance(q, k, v, dout, spec.causal, d ** -0.5)
            for name, got, ref, tol in zip("qkv", grads, refs, tols):
                err = (got.float() - ref).abs().max().item()
                if not err <= tol:  # NaN fails too
                    return f"d{name}: max error {err:.3e} > {tol:.3e} at nq={nq}, nk={nk}, d={d}"
        return ""

    def _time_on_gpu(self, key, spec) -> float:
        import torch

        from ..api import attention

        if space.is_backward(key.kind):
            return self._time_backward(key, spec)
        if variants.key_flags(key.variant)["varlen"]:
            return self._time_varlen(key, spec)
        b, h, hk, nq, nk, d = space.measured_shape(key, self.shapes)
        fp8 = variants.key_flags(key.variant)["fp8"]
        sig = (key.dtype, b, h, hk, nq, nk, d, fp8)
        if sig not in self._inputs:
            self._inputs.clear()  # one shape at a time: 3 x 64 MB, larger than L2
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[key.dtype]
            qkv = (torch.randn(b, h, nq, d, device=self.device, dtype=dtype),
                   *(torch.randn(b, hk, nk, d, device=self.device, dtype=dtype) for _ in range(2)))
            if fp8:  # FP8 inputs (per-head descales) with the key's dtype as the output's
                from ..api.fp8 import quantize_fp8

                (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(t) for t in qkv)
                qkv = (q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd, "out_dtype": dtype,
                                    "check_values": False})
            self._inputs[sig] = qkv
        q, k, v, *fp8_kw = self._inputs[sig]
        kw = variants.tuning_kwargs(key.variant, key.causal, max(nq, nk), h, self.device)
        kw.update(fp8_kw[0] if fp8_kw else {})
        if variants.mod_of(key.variant):
            kw.update(mod_kwargs(variants.mod_of(key.variant)))
        return median_ms(lambda: attention(q, k, v, causal=key.causal, spec=spec, **kw))

    def _time_varlen(self, key, spec) -> float:
        """One packed-rows call over ``space.tuning_lengths`` (query and key lengths equal), ``spec`` forced."""
        import torch

        from ..api import attention_varlen

        _, h, hk, _, _, d = space.measured_shape(key, self.shapes)  # (recorded: its heads and head dim)
        n = key.bucket
        lengths = space.tuning_lengths(key)
        sig = ("varlen", key.dtype, h, hk, n, d)
        if sig not in self._inputs:
            self._inputs.clear()
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[key.dtype]
            qkv = (torch.randn(sum(lengths), h, d, device=self.device, dtype=dtype),
                   *(torch.randn(sum(lengths), hk, d, device=self.device, dtype=dtype) for _ in range(2)))
            cu = torch.tensor([0, *itertools.accumulate(lengths)], device=self.device, dtype=torch.int32)
            self._inputs[sig] = (*qkv, cu)
        q, k, v, cu = self._inputs[sig]
        kw = variants.tuning_kwargs(key.variant, key.causal, n, h, self.device)
        return median_ms(lambda: attention_varlen(q, k, v, cu, cu, n, n, key.causal, spec=spec, check_values=False,
                                                  **kw))

    def _time_backward(self, key, spec) -> float:
        """One whole backward at the key's shape, ``spec`` forced for the key's kind."""
        import torch

        from ..api import attention, attention_backward

        b, h, hk, nq, nk, d = space.measured_shape(key, self.shapes)
        sig = ("bwd", key.dtype, b, h, hk, nq, nk, d, key.causal)
        if sig not in self._inputs:
            self._inputs.clear()  # one shape at a time: q, k, v, dO, O of 64 MB each
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[key.dtype]
            q, dout = (torch.randn(b, h, nq, d, device=self.device, dtype=dtype) for _ in range(2))
            k, v = (torch.randn(b, hk, nk, d, device=self.device, dtype=dtype) for _ in range(2))
            out, lse = attention(q, k, v, causal=key.causal, return_lse=True)
            self._inputs[sig] = (q, k, v, dout, out, lse)
        q, k, v, dout, out, lse = self._inputs[sig]
        mode, forced = space.BWD_KEY_MODES[key.kind], {key.kind: spec}
        return median_ms(lambda: attention_backward(dout, q, k, v, out, lse, key.causal, d ** -0.5,
                                                    dq_mode=mode, specs=forced))
