"""User mods: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and
``mask_mod(b, h, q_idx, kv_idx) -> bool``, traced once into a small typed expression graph that is
printed as a CUDA device function (no user text reaches the source) and evaluated with torch for the
fp32 reference.

**Tracing.** The function runs once on symbolic values (``Sym``). Python operators are overloaded;
torch functions called on them reach ``Sym.__torch_function__``; indexing a captured tensor with
traced indices (``bias[h, q_idx - kv_idx]``) reaches it too, as ``Tensor.__getitem__`` (torch checks an
index tuple for objects that override torch functions before it reads them). Only a whitelist is
accepted (``SUPPORTED``); anything else, Python control flow on a traced value (``if``, ``and``, ``min``
...) and in-place operations raise ``ModError`` naming the operation.

**Types and semantics**, the same in the printed CUDA and in ``Graph.evaluate``:

- three types: ``f32``, ``i32`` (every integer, ``.long()`` included, is an int32) and ``bool``; the
  indices are i32 and the score f32. Promotion as torch does it for these: int with float gives f32,
  ``/`` always f32, comparisons bool; bools in arithmetic count as ints, two bools are refused.
- ``//`` and ``%`` follow Python (floor): on ints ``a // b`` is C's ``a / b`` minus one when the
  remainder is nonzero and its sign differs from ``b``'s, and ``a % b`` adds ``b`` to such a remainder;
  an int division by zero gives 0 (a constant zero divisor is refused when traced). On floats ``a // b``
  is ``floor(a / b)`` and ``a % b`` is ``fmod`` moved into ``b``'s sign.
- float ``+ - *`` use round-to-nearest intrinsics (no FMA contraction), so they match torch's fp32 bit
  for bit; ``/`` (a constant divisor: a multiply by its reciprocal) and ``exp``, ``log``, ``tanh``,
  ``sqrt``... use the hardware's approximations, as the kernels' softmax does (relative error a few
  2^-23; tanh 2^-11), far below the bf16 rounding of what the scores become. ``minimum``/``maximum``/``clamp`` on
  floats are ``fminf``/``fmaxf`` (a NaN operand yields the other one: ``torch.fmin``'s rule). A float
  cast to int truncates, saturates at the int32 range, and maps NaN to 0.
- float constants are kept exactly in the graph (and its hash) and rounded to float32 in the kernel;
  NaN and finite constants beyond float32's range are refused, infinities print as ``INFINITY``.
- ``torch.minimum``/``maximum`` take two traced values (torch's own argument check refuses a Python
  number there before the tracer sees the call: use ``clamp``).
- a captured tensor (CUDA; 1 to 4 dims; float32, float16, bfloat16, int32, int64 or bool; at most 4 per
  graph) is read as f32, i32 (int64 narrowed) or bool. Every index is clamped into ``[0, size - 1]``: an
  out-of-range index, negative ones included, reads the nearest element instead of faulting (Python's
  wrap-around of negative indices does not apply).

**Derivative.** ``derivative(graph)`` is d score_mod / d score as a graph of the same captures
(``mods/grad.py``): the factor the backward kernel (``bwd_sm90``) multiplies dS by, printed with the
score_mod's value in one function (``ModPair.cuda_backward``).
"""
from __future__ import annotations

import functools
import hashlib
import sys
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass, field

from .. import files
from .grad import derivative
from .graph import MAX_CAPTURES, Graph, ModError, Node, UnknownModError, passthrough_cuda
from .linear import linear_form
from .trace import SUPPORTED, Sym, is_tensor, trace

__all__ = ["SUPPORTED", "Graph", "ModError", "ModPair", "Node", "Sym", "UnknownModError", "derivative", "lookup",
           "of_number", "pair", "register", "token_number", "token_text", "trace_mask_mod", "trace_pair",
           "trace_score_mod"]


def trace_score_mod(fn, *, allow_cpu: bool = False) -> Graph:
    """The graph of ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (float). ``allow_cpu`` accepts
    captured CPU tensors (for tests and the CPU reference; a kernel needs them on the GPU)."""
    return _traced("score", fn, allow_cpu)


def trace_mask_mod(fn, *, allow_cpu: bool = False) -> Graph:
    """The graph of ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: the key is visible)."""
    return _traced("mask", fn, allow_cpu)


# The trace cache: (id(fn), kind, allow_cpu) -> (fn, fingerprint, graph, the fingerprint's tensors), least
# recently used first. A trace is reused only while ``fn`` is the same object and everything it can read
# besides its arguments is unchanged (``_fingerprint``); its entries keep their tensors alive (so that
# no id is reused), which is why the cache is small.
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64
_LOCK = threading.Lock()


def _traced(kind: str, fn, allow_cpu: bool) -> Graph:
    if not callable(fn):
        raise TypeError(f"{'score_mod' if kind == 'score' else 'mask_mod'} must be a function, got {fn!r}")
    key = (id(fn), kind, bool(allow_cpu))
    held: list = []
    mark = _fingerprint(fn, held, 0)
    with _LOCK:
        entry = _CACHE.get(key)
        if entry is not None and entry[0] is fn and mark is not None and entry[1] == mark:
            _CACHE.move_to_end(key)
            return entry[2]
    graph = trace(kind, fn, allow_cpu)
    if mark is not None:
        with _LOCK:
            _CACHE[key] = (fn, mark, graph, held)
            _CACHE.move_to_end(key)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return graph


def _is_dtype(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)


def _fingerprint(fn, held: list, depth: int):
    """What a trace of ``fn`` can read besides its arguments: its code, closure cells, the globals its code
    names and its defaults. Tensors count by (id, data_ptr, shape, dtype, device), so rebinding a captured
    global to another tensor is seen; plain constants by value; functions recursively. None (trace on
    every call) when it reads anything else: a bound method's object, a list, a module's attribute
    cannot be compared cheaply, nor can a module's attributes (only torch, math and operator count, by
    identity)."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__self__", None) is not None or depth > 4:
        return None
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo += [k for k in c.co_consts if hasattr(k, "co_names")]
    values = []
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            values.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            return None
    values += [(name, fn.__globals__[name]) for name in sorted(names) if name in fn.__globals__]
    values += [("", v) for v in (fn.__defaults__ or ())] + sorted((fn.__kwdefaults__ or {}).items())
    out = [code]
    for name, v in values:
        if v is None or isinstance(v, (bool, int, float, str)):
            mark = (type(v).__name__, repr(v))
        elif is_tensor(v):
            held.append(v)
            mark = ("tensor", id(v), v.data_ptr(), tuple(v.shape), str(v.dtype), str(v.device))
        elif isinstance(v, (types.BuiltinFunctionType, type)) or _is_dtype(v) or (
                isinstance(v, types.ModuleType) and v.__name__.split(".")[0] in ("torch", "math", "operator")):
            held.append(v)
            mark = ("object", id(v))
        elif hasattr(v, "__code__"):
            mark = _fingerprint(v, held, depth + 1)
        else:
            return None
        if mark is None:
            return None
        out.append((name, mark))
    return tuple(out)


# ---------------------------------------------------------------- pairs and the registry


@dataclass(frozen=True)
class ModPair:
    """A call's score_mod and mask_mod graphs (either may be None, not both). ``token`` (12 hex digits of
    the sha256 of both hashes) is what a kernel's name carries; the captures take the 4 slots of
    ``fg_mod_args`` in order, the score's from 0 and the mask's after them (a tensor both read takes
    two slots)."""

    score: Graph | None
    mask: Graph | None
    token: str = field(init=False)

    def __post_init__(self):
        for graph, kind in ((self.score, "score"), (self.mask, "mask")):
            if graph is not None and (not isinstance(graph, Graph) or graph.kind != kind):
                raise ModError(f"the {kind} half of a mod pair must be a traced {kind}_mod graph, got {graph!r}")
        if self.score is None and self.mask is None:
            raise ModError("a mod pair needs a score_mod or a mask_mod")
        if len(self.captures) > MAX_CAPTURES:
            raise ModError(f"score_mod and mask_mod capture {len(self.captures)} tensors together "
                           f"(at most {MAX_CAPTURES})")
        text = f"score:{self.score.hash if self.score else '-'}\nmask:{self.mask.hash if self.mask else '-'}"
        object.__setattr__(self, "token", hashlib.sha256(text.encode()).hexdigest()[:12])

    @property
    def captures(self) -> tuple:
        return (self.score.captures if self.score else ()) + (self.mask.captures if self.mask else ())

    @property
    def factors(self) -> tuple[float, float]:
        """The score_mod's (k, c) (``Graph.factors``): the kernel multiplies the raw score by scale * k
        before fg_score_mod and runs the softmax on c times its result (1.0, 1.0 without a score_mod)."""
        return self.score.factors() if self.score else (1.0, 1.0)

    @functools.cached_property
    def linear(self):
        """The score_mod's ``mods.linear.LinearForm`` (a bias linear in kv: x + a(b, h) kv + r(b, h, q), with
        |q - kv| read as q - kv where the mask_mod orders the keys), or None."""
        return linear_form(self.score, self.mask)

    def cuda(self, linear: bool = False) -> str:
        """``fg_score_mod`` (its factors folded out: ``factors``) and ``fg_mask_mod`` (a pass-through one
        for a missing half; its per-head reads apart: ``Graph.cuda_hoisted``); ``linear`` (a pair whose
        ``linear`` is not None) adds that form's functions, of the same arguments: ``fg_score_mod_lin`` (f, |.|
        rewritten), ``fg_score_mod_kv`` (a) and, where r is linear in q, ``fg_score_mod_q`` (its coefficient)."""
        score = self.score.cuda("fg_score_mod", fold=True) if self.score else passthrough_cuda("score", "fg_score_mod")
        if linear:
            form = self.linear
            if form is None:
                raise ModError(f"mod {self.token}: its score_mod is not a bias linear in kv_idx")
            score += "\n" + form.f.cuda("fg_score_mod_lin") + "\n" + form.kv_coef.cuda("fg_score_mod_kv")
            if form.q_coef is not None:
                score += "\n" + form.q_coef.cuda("fg_score_mod_q")
        return score + "\n" + self._mask_cuda()

    def _mask_cuda(self) -> str:
        """``fg_mask_mod`` with its per-head part apart (``Graph.cuda_hoisted``), or the pass-through one."""
        if self.mask is None:
            return passthrough_cuda("mask", "fg_mask_mod")
        return self.mask.cuda_hoisted("fg_mask_mod", len(self.score.captures) if self.score else 0)

    @property
    def score_grad(self) -> Graph | None:
        """f' of the score_mod ``c * f(k * score)`` (``factors``; f the whole function where nothing folds):
        ``derivative`` of ``Graph.inner``, or None where it is the constant 1 (no score_mod, or one that
        only adds to the score or scales it: a bias, ALiBi). The backward kernel multiplies dS by it and
        the gradients by c k (beside the softmax scale)."""
        if self.score is None:
            return None
        grad = derivative(self.score.inner())
        return None if grad.constant() == 1.0 else grad

    def cuda_backward(self) -> str:
        """The backward kernel's functions: ``fg_score_mod`` folded as the forward's (``cuda``), with
        ``fg_score_mod_grad(..., float& grad)``, f's value and f' in one function, where ``score_grad``
        is not None, and ``fg_mask_mod``."""
        if self.score is None:
            score = passthrough_cuda("score", "fg_score_mod")
        else:
            score = self.score.cuda("fg_score_mod", fold=True)
            grad = self.score_grad
            if grad is not None:
                score += "\n" + grad.cuda_with_value("fg_score_mod_grad", len(self.score.inner().nodes) - 1)
        return score + "\n" + self._mask_cuda()


def from_files(score_text: str | None, mask_text: str | None, allow_cpu: bool = False,
               labels=("--score-mod", "--mask-mod")) -> tuple:
    """(pair, (score_fn, mask_fn)) of the functions ``FILE.py:NAME`` names (``files.user_function``: FILE is
    imported), traced and registered: the command line's mods (``flashgen emit/compile/tune --score-mod``).
    ``ModError`` naming ``labels``' option for a file or function that is not there, and as ``trace``'s."""
    fns = []
    for label, text in zip(labels, (score_text, mask_text)):
        try:
            fns.append(files.user_function(text) if text else None)
        except ValueError as exc:
            raise ModError(f"{label} {exc}" if str(exc).startswith("'") else f"{label}: {exc}") from None
    score_fn, mask_fn = fns
    found = trace_pair(score_fn, mask_fn, allow_cpu=allow_cpu)
    register(found)
    return found, (score_fn, mask_fn)


def pair(score: Graph | None, mask: Graph | None) -> ModPair:
    """The pair of a call's traced mods (``ModError`` for more than 4 captures together)."""
    return ModPair(score, mask)


def trace_pair(score_fn, mask_fn, allow_cpu: bool = False) -> ModPair:
    """The pair of a score_mod and a mask_mod function (either may be None), each traced (``trace``)."""
    return ModPair(trace_score_mod(score_fn, allow_cpu=allow_cpu) if score_fn is not None else None,
                   trace_mask_mod(mask_fn, allow_cpu=allow_cpu) if mask_fn is not None else None)


_REGISTRY: dict = {}


def register(mods: ModPair) -> str:
    """Keep ``mods`` for this process under its token (a later pair of the same token replaces it: its
    captures are the live ones) and return the token."""
    if not isinstance(mods, ModPair):
        raise TypeError(f"register takes a ModPair, got {mods!r}")
    with _LOCK:
        _REGISTRY[mods.token] = mods
    return mods.token


def lookup(token: str) -> ModPair:
    """The registered pair of ``token``; ``UnknownModError`` (a ``ModError`` and a ``KeyError``) when this
    process has none, as in a kernel name from a table or another process."""
    with _LOCK:
        found = _REGISTRY.get(token)
    if found is None:
        raise UnknownModError(f"mod {token} is not known in this process: pass the score_mod/mask_mod to the "
                              f"call that uses it")
    return found


def token_number(mods: ModPair) -> int:
    """A pair's token as the number a KernelSpec's ``mod`` field holds (48 bits; 0 is "no mods")."""
    return int(mods.token, 16)


def token_text(number: int) -> str:
    """The token (12 hex digits) of a KernelSpec's ``mod`` number."""
    return f"{number:012x}"


def of_number(number: int) -> ModPair:
    """The registered pair of a KernelSpec's ``mod`` number (``lookup``'s errors)."""
    return lookup(token_text(number))
