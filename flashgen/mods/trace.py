"""Tracing a mod: ``Sym`` (a traced value: operator overloads and ``__torch_function__``), the tracer that
records typed, hash-consed nodes and refuses whatever is not on the whitelist, and ``trace``, which runs a
function once and returns its ``Graph``. No torch at import: it is looked up where a value may be a
tensor, and imported when a torch function is first intercepted."""
from __future__ import annotations

import hashlib
import math
import struct
import sys

from .graph import INPUTS, INT32_MAX, INT32_MIN, MAX_CAPTURES, Graph, ModError, Node, const_text

SUPPORTED = ("+ - * / // % (unary -) abs() < <= > >= == != & | ~, torch.where/abs/exp/exp2/log/log2/tanh/sqrt/"
             "rsqrt/sigmoid/minimum/maximum/clamp/logical_and/logical_or/logical_not, .float() .int() .long() "
             ".bool() .to(dtype), int/float/bool constants, captured tensors indexed by traced indices")
MAX_DIMS = 4
# torch dtype name -> the node type a load gives.
CAPTURE_DTYPES = {"float32": "f32", "float16": "f32", "bfloat16": "f32", "int32": "i32", "int64": "i32",
                  "bool": "bool"}
COMMUTATIVE = frozenset(("add", "mul", "and", "or", "eq", "ne", "min", "max"))
UNARY_FLOAT = ("exp", "exp2", "log", "log2", "tanh", "sqrt", "rsqrt", "sigmoid")


class _N:
    """A node while tracing: interned per trace, args are _N objects; ``skey`` is a digest of its structure
    that leaves captured tensors' identities out (the order of commutative operands)."""

    __slots__ = ("op", "dtype", "args", "skey")

    def __init__(self, op, dtype, args, skey):
        self.op, self.dtype, self.args, self.skey = op, dtype, args, skey


class _Tracer:
    """One trace's state: its interned nodes and captured tensors (trace order), and the refusals, each
    prefixed with the function's role."""

    def __init__(self, kind: str, allow_cpu: bool):
        self.kind, self.allow_cpu = kind, allow_cpu
        self.who = "score_mod" if kind == "score" else "mask_mod"
        self.interned: dict = {}
        self.tensors: list = []  # distinct captured tensors, trace order
        self.scalars: dict = {}  # id of a one-element view (t[0]) -> (the view, its read)

    def scalar(self, x):
        """A one-element view of a captured tensor -- ``t[0]`` with a constant index, which torch evaluates
        itself while tracing -- as a read of that element (its storage is the captured tensor's, so the
        kernel reads what the call sees); anything else unchanged. A tensor computed while tracing is no
        view and stays refused."""
        if is_tensor(x) and x.numel() == 1 and x._base is not None:
            found = self.scalars.get(id(x))
            if found is None:
                found = self.scalars[id(x)] = (x, self.load(x.reshape(1), (0,)))
            return found[1]
        return x

    def fail(self, text: str):
        raise ModError(f"{self.who}: {text}")

    def unsupported(self, what: str):
        self.fail(f"{what} is not supported in a mod (supported: {SUPPORTED})")

    def node(self, op: str, dtype: str, args: tuple) -> _N:
        if op in COMMUTATIVE:
            args = tuple(sorted(args, key=lambda n: n.skey))
        if op == "const":
            key = (op, const_text(dtype, args[0]))
            parts = key
        elif op == "load":
            key = (op, dtype, args)
            t = self.tensors[args[0]]
            parts = (op, dtype, str(t.dtype), t.dim(), *(a.skey for a in args[1:]))
        else:
            key = (op, dtype, args)
            parts = (op, dtype, *(a.skey if isinstance(a, _N) else a for a in args))
        found = self.interned.get(key)
        if found is None:
            skey = hashlib.sha256(repr(parts).encode()).digest()
            found = self.interned[key] = _N(op, dtype, args, skey)
        return found

    def sym(self, op, dtype, args) -> "Sym":
        return Sym(self, self.node(op, dtype, args))

    # ---- values

    def const(self, value, dtype: str) -> _N:
        if dtype == "f32":
            try:
                value = float(value)
            except OverflowError:
                self.fail(f"the constant {value!r} is outside float32's range")
            if math.isnan(value):
                self.fail("a NaN constant cannot be used in a mod")
            if math.isfinite(value):
                try:
                    struct.pack("<f", value)
                except OverflowError:
                    self.fail(f"the constant {value!r} is outside float32's range")
        elif dtype == "i32":
            value = int(value)
            if not INT32_MIN <= value <= INT32_MAX:
                self.fail(f"the integer constant {value} does not fit int32")
        return self.node("const", dtype, (bool(value) if dtype == "bool" else value,))

    def natural(self, x) -> str:
        """The type of a Sym or a Python constant; anything else is refused."""
        x = self.scalar(x)
        if isinstance(x, Sym):
            if x.tracer is not self:
                self.fail("a traced value from another trace was used")
            return x.node.dtype
        if isinstance(x, _View):
            self.fail(f"a {x.tensor.dim()}-dim captured tensor is indexed by {len(x.index)} index(es): "
                      f"index every dim (t[i, j])")
        if isinstance(x, bool):
            return "bool"
        if isinstance(x, int):
            return "i32"
        if isinstance(x, float):
            return "f32"
        if is_tensor(x):
            self.fail("a torch tensor is used whole: read captured tensors by traced indices (t[h, q_idx]) or "
                      "one element by a constant one (t[0]); a tensor computed while tracing (torch.tensor(...), "
                      "t * 2) cannot be captured")
        self.fail(f"a value of type {type(x).__name__} cannot be used in a mod")

    def to(self, x, dtype: str) -> _N:
        """``x`` (a Sym or a constant) as a node of ``dtype``, cast where needed."""
        x = self.scalar(x)
        if not isinstance(x, Sym):
            self.natural(x)
            return self.const(x, dtype)
        if x.node.dtype == dtype:
            return x.node
        if x.node.op == "const":
            return self.const(x.node.args[0], dtype)
        return self.node("cast", dtype, (x.node,))

    # ---- operations

    def binary(self, op: str, x, y) -> "Sym":
        tx, ty = self.natural(x), self.natural(y)
        if op in ("and", "or"):
            if tx != "bool" or ty != "bool":
                self.fail(f"{'&' if op == 'and' else '|'} takes bool values here (bitwise integer ops are not "
                          f"supported)")
            return self.sym(op, "bool", (self.to(x, "bool"), self.to(y, "bool")))
        if op in ("lt", "le", "eq", "ne"):
            common = _promote(tx, ty)
            return self.sym(op, "bool", (self.to(x, common), self.to(y, common)))
        if tx == ty == "bool":
            self.fail("arithmetic on two bool values: cast one with .int() or .float()")
        dtype = "f32" if op == "div" else _promote(tx, ty, arithmetic=True)
        a, b = self.to(x, dtype), self.to(y, dtype)
        if op in ("div", "floordiv", "mod") and b.op == "const" and b.args[0] == 0:
            self.fail("division by a constant zero")
        return self.sym(op, dtype, (a, b))

    def unary(self, op: str, x) -> "Sym":
        t = self.natural(x)
        if op == "not":
            if t != "bool":
                self.fail("~ takes a bool value here (bitwise integer ops are not supported)")
            return self.sym("not", "bool", (self.to(x, "bool"),))
        if op in UNARY_FLOAT:
            return self.sym(op, "f32", (self.to(x, "f32"),))
        if t == "bool":
            self.fail(f"{'unary -' if op == 'neg' else op} on a bool value")
        return self.sym(op, t, (self.to(x, t),))

    def where(self, cond, x, y) -> "Sym":
        if self.natural(cond) != "bool":
            self.fail("torch.where's condition must be a bool value (a comparison)")
        dtype = _promote(self.natural(x), self.natural(y))
        return self.sym("where", dtype, (self.to(cond, "bool"), self.to(x, dtype), self.to(y, dtype)))

    def clamp(self, x, lo=None, hi=None) -> "Sym":
        out = x
        if lo is not None:
            out = self.binary("max", out, lo)
        if hi is not None:
            out = self.binary("min", out, hi)
        if not isinstance(out, Sym):
            self.fail("clamp needs a traced value")
        return out

    def cast(self, x, dtype: str) -> "Sym":
        if dtype == "bool":
            return self.truth(x)
        self.natural(x)
        return Sym(self, self.to(x, dtype))

    def truth(self, x) -> "Sym":
        """``x != 0`` as a bool value (a bool stays itself): torch's ``.bool()`` and logical_* operands."""
        return Sym(self, self.to(x, "bool")) if self.natural(x) == "bool" else self.binary("ne", x, 0)

    def logical(self, op: str, *xs) -> "Sym":
        bools = [self.truth(x) for x in xs]
        return self.unary("not", bools[0]) if op == "not" else self.binary(op, *bools)

    def load(self, tensor, index) -> "Sym | _View":
        index = index if isinstance(index, tuple) else (index,)
        slot = next((i for i, t in enumerate(self.tensors) if t is tensor), None)
        if slot is None:
            self.check_capture(tensor)
            slot = len(self.tensors)
            self.tensors.append(tensor)
        nodes = []
        for i in index:
            if isinstance(i, bool) or not isinstance(i, (int, Sym)):
                self.fail(f"a captured tensor is indexed by {type(i).__name__}: only int indices (traced or "
                          f"constant) are supported, no slices, masks or tensors")
            if isinstance(i, int) and i < 0:
                self.fail(f"the negative constant index {i}: indices are clamped into range, not wrapped")
            if self.natural(i) != "i32":
                self.fail("a captured tensor is indexed by a float or bool value: cast it with .int()")
            nodes.append(self.to(i, "i32"))
        if len(nodes) > tensor.dim():
            self.fail(f"a {tensor.dim()}-dim captured tensor is indexed by {len(nodes)} indices")
        if len(nodes) < tensor.dim():
            return _View(self, tensor, tuple(nodes))
        return self.sym("load", CAPTURE_DTYPES[str(tensor.dtype).replace("torch.", "")], (slot, *nodes))

    def check_capture(self, t):
        device = t.device.type
        if device == "cpu" and not self.allow_cpu:
            self.fail("captures a CPU tensor: captured tensors must be on the GPU the attention runs on")
        if device not in ("cuda", "cpu"):
            self.fail(f"captures a tensor on {t.device}: captured tensors must be CUDA tensors")
        name = str(t.dtype).replace("torch.", "")
        if name not in CAPTURE_DTYPES:
            self.fail(f"captures a {name} tensor (supported dtypes: {', '.join(CAPTURE_DTYPES)})")
        if not 1 <= t.dim() <= MAX_DIMS:
            self.fail(f"captures a {t.dim()}-dim tensor (1 to {MAX_DIMS} dims are supported)")
        if t.numel() == 0 or max(t.shape) > INT32_MAX:
            self.fail(f"captures a tensor of shape {tuple(t.shape)} (every size must be in 1..2^31-1)")


def _promote(a: str, b: str, arithmetic: bool = False) -> str:
    if "f32" in (a, b):
        return "f32"
    if "i32" in (a, b) or arithmetic:
        return "i32"
    return "bool"


def is_tensor(x) -> bool:
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return torch is not None and isinstance(x, torch.Tensor)


class _View:
    """A captured tensor indexed in fewer dims than it has (``bias[h]`` of a 2-dim ``bias``): only more
    indexing is allowed (``bias[h][q_idx]``)."""

    def __init__(self, tracer, tensor, index):
        self.tracer, self.tensor, self.index = tracer, tensor, index

    def __getitem__(self, more):
        more = more if isinstance(more, tuple) else (more,)
        return self.tracer.load(self.tensor, tuple(Sym(self.tracer, n) for n in self.index) + more)

    def __bool__(self):
        self.tracer.natural(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _binop(op, swap=False):
    def method(self, other):
        return self.tracer.binary(op, other, self) if swap else self.tracer.binary(op, self, other)
    return method


def _refused(what):
    def method(self, *args, **kwargs):
        self.tracer.unsupported(what)
    return method


def _float_method(op):
    def method(self):
        return self.tracer.unary(op, self)
    return method


class Sym:
    """A traced value: operators and whitelisted torch functions on it record graph nodes."""

    __slots__ = ("tracer", "node")

    def __init__(self, tracer: _Tracer, node: _N):
        self.tracer, self.node = tracer, node

    __add__, __radd__ = _binop("add"), _binop("add", True)
    __sub__, __rsub__ = _binop("sub"), _binop("sub", True)
    __mul__, __rmul__ = _binop("mul"), _binop("mul", True)
    __truediv__, __rtruediv__ = _binop("div"), _binop("div", True)
    __floordiv__, __rfloordiv__ = _binop("floordiv"), _binop("floordiv", True)
    __mod__, __rmod__ = _binop("mod"), _binop("mod", True)
    __and__, __rand__ = _binop("and"), _binop("and", True)
    __or__, __ror__ = _binop("or"), _binop("or", True)
    __lt__, __le__ = _binop("lt"), _binop("le")
    __gt__, __ge__ = _binop("lt", True), _binop("le", True)  # a > b is b < a: one spelling per comparison
    __eq__, __ne__ = _binop("eq"), _binop("ne")
    __hash__ = None
    __pow__ = __rpow__ = _refused("**")
    __xor__ = __rxor__ = _refused("^")
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = _refused("a shift (<< >>)")
    __matmul__ = __rmatmul__ = _refused("@")
    __divmod__ = __rdivmod__ = _refused("divmod()")
    __getitem__ = _refused("indexing a traced value (only captured tensors can be indexed)")
    __setitem__ = _refused("item assignment (in place)")
    __iter__ = __len__ = _refused("iterating a traced value")

    def __neg__(self):
        return self.tracer.unary("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return self.tracer.unary("abs", self)

    def __invert__(self):
        return self.tracer.unary("not", self)

    def __bool__(self):
        self.tracer.fail("Python control flow (if/while/and/or/not/min/max) on a traced value cannot be traced: "
                         "use torch.where, & | ~, torch.minimum/maximum")

    def __float__(self):
        self.tracer.unsupported("float()/int()/math.* on a traced value")

    __int__ = __index__ = __complex__ = __float__

    exp, exp2, log, log2, tanh, sqrt, rsqrt, sigmoid = (_float_method(op) for op in UNARY_FLOAT)
    abs = __abs__

    def float(self):
        return self.tracer.cast(self, "f32")

    def int(self):
        return self.tracer.cast(self, "i32")

    long = int

    def bool(self):
        return self.tracer.truth(self)

    def to(self, *args, **kwargs):
        return _dispatch(_torch()["Tensor"].to, (self, *args), kwargs)

    def clamp(self, min=None, max=None):
        return self.tracer.clamp(self, min, max)

    clip = clamp

    def minimum(self, other):
        return self.tracer.binary("min", self, other)

    def maximum(self, other):
        return self.tracer.binary("max", self, other)

    def where(self, cond, other):
        return self.tracer.where(cond, self, other)

    def logical_and(self, other):
        return self.tracer.logical("and", self, other)

    def logical_or(self, other):
        return self.tracer.logical("or", self, other)

    def logical_not(self):
        return self.tracer.logical("not", self)

    def __getattr__(self, name):
        if name.startswith("_"):  # probes of private or special names get the usual answer
            raise AttributeError(name)
        what = f"the in-place Tensor.{name}" if name.endswith("_") else f"Tensor.{name}"
        self.tracer.unsupported(what)

    def __repr__(self):
        return f"Sym({self.node.op}:{self.node.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


_TORCH: dict = {}


def _torch() -> dict:
    """torch's functions that a mod may call, by the handler that takes them (built on first use)."""
    if not _TORCH:
        import torch

        T = torch.Tensor
        table = {T.__getitem__: "getitem", T.to: "to", torch.where: "where", T.where: "twhere",
                 torch.clamp: "clamp", T.clamp: "clamp", torch.clip: "clamp", T.clip: "clamp",
                 torch.minimum: "min", T.minimum: "min", torch.maximum: "max", T.maximum: "max",
                 torch.abs: "abs", T.abs: "abs", T.__abs__: "abs", torch.neg: "neg", T.neg: "neg", T.__neg__: "neg",
                 T.float: "f32", T.int: "i32", T.long: "i32", T.bool: "bool"}
        for op in UNARY_FLOAT:
            table[getattr(torch, op)] = table[getattr(T, op)] = op
        for op in ("logical_and", "logical_or", "logical_not"):
            table[getattr(torch, op)] = table[getattr(T, op)] = op
        names = {"add": ("add",), "sub": ("sub", "subtract"), "mul": ("mul", "multiply"), "div": ("div", "true_divide"),
                 "floordiv": ("floor_divide",), "mod": ("remainder",), "lt": ("lt", "less"), "le": ("le",),
                 "gt": ("gt", "greater"), "ge": ("ge",), "eq": ("eq",), "ne": ("ne", "not_equal")}
        for op, spellings in names.items():
            for s in spellings:
                table[getattr(torch, s)] = table[getattr(T, s)] = op
        _TORCH.update(table, Tensor=T, dtypes={torch.float32: "f32", torch.int32: "i32", torch.int64: "i32",
                                               torch.bool: "bool"})
    return _TORCH


def _func_name(func) -> str:
    import torch

    name = getattr(func, "__name__", None)
    for prefix, space in (("torch.", torch), ("torch.nn.functional.", torch.nn.functional),
                          ("torch.special.", torch.special), ("torch.linalg.", torch.linalg), ("Tensor.", torch.Tensor)):
        if name and getattr(space, name, None) is func:
            return prefix + name
    return name or repr(func)


def _find_tracer(items) -> _Tracer | None:
    for x in items:
        if isinstance(x, (Sym, _View)):
            return x.tracer
        if isinstance(x, (tuple, list)):
            found = _find_tracer(x)
            if found:
                return found
    return None


def _dispatch(func, args, kwargs):
    """A torch function called with a traced value among its arguments."""
    tracer = _find_tracer((*args, *kwargs.values()))
    if tracer is None:
        raise ModError(f"{_func_name(func)} received a traced value it cannot take")
    table = _torch()
    op = table.get(func)
    if op is None or "out" in kwargs:
        name = _func_name(func)
        in_place = name.endswith("_") and not name.endswith("__")
        if func is table["Tensor"].__setitem__ or in_place or "out" in kwargs:
            tracer.unsupported(f"the in-place {name}")
        for x in args:
            if is_tensor(x) and func is not table["Tensor"].__getitem__:
                tracer.natural(x)  # a tensor used whole, as in tensor & traced
        tracer.unsupported(name)
    if op == "getitem":
        base = args[0]
        if not is_tensor(base):
            tracer.unsupported("indexing a traced value (only captured tensors can be indexed)")
        return tracer.load(base, args[1])
    allowed = {"clamp": {"min", "max"}, "to": {"dtype"}}.get(op, set())
    if set(kwargs) - allowed:
        tracer.unsupported(f"{_func_name(func)} with {', '.join(sorted(set(kwargs) - allowed))}=")
    if op == "to":
        dtype = kwargs.get("dtype", args[1] if len(args) == 2 else None)
        if len(args) > 2 or dtype not in table["dtypes"]:
            tracer.unsupported(f".to({', '.join(map(str, args[1:]))}) (casts to float32, int32, int64, bool only)")
        return tracer.cast(args[0], table["dtypes"][dtype])
    if op == "clamp":
        lo = kwargs.get("min", args[1] if len(args) > 1 else None)
        hi = kwargs.get("max", args[2] if len(args) > 2 else None)
        return tracer.clamp(args[0], lo, hi)
    expected = {"where": 3, "twhere": 3, "logical_not": 1, "abs": 1, "neg": 1, "f32": 1, "i32": 1, "bool": 1,
                **{u: 1 for u in UNARY_FLOAT}}.get(op, 2)
    if len(args) != expected:
        tracer.unsupported(f"{_func_name(func)} with {len(args)} argument(s)")
    if op == "where":
        return tracer.where(*args)
    if op == "twhere":
        return tracer.where(args[1], args[0], args[2])
    if op.startswith("logical_"):
        return tracer.logical(op[8:], *args)
    if op in ("f32", "i32"):
        return tracer.cast(args[0], op)
    if op == "bool":
        return tracer.truth(args[0])
    if op in ("gt", "ge"):
        return tracer.binary("lt" if op == "gt" else "le", args[1], args[0])
    if expected == 1:
        return tracer.unary(op, args[0])
    return tracer.binary(op, *args)


def _finish(tracer: _Tracer, root: _N) -> Graph:
    """The graph of what ``root`` needs, in a depth-first order of canonical operands (so that spellings
    of one mod give one node list), captures renumbered by first use."""
    order, at = [], {}
    stack = [(root, False)]
    while stack:
        n, ready = stack.pop()
        if id(n) in at:
            continue
        kids = [] if n.op in ("in", "const") else list(n.args[1:] if n.op == "load" else n.args)
        if ready:
            at[id(n)] = len(order)
            order.append(n)
            continue
        stack.append((n, True))
        stack += [(k, False) for k in reversed(kids) if id(k) not in at]
    slots = {}
    for n in order:
        if n.op == "load":
            slots.setdefault(n.args[0], len(slots))
    if len(slots) > MAX_CAPTURES:
        tracer.fail(f"captures {len(slots)} tensors (at most {MAX_CAPTURES})")
    nodes = []
    for n in order:
        if n.op in ("in", "const"):
            args = n.args
        elif n.op == "load":
            args = (slots[n.args[0]], *(at[id(x)] for x in n.args[1:]))
        else:
            args = tuple(at[id(x)] for x in n.args)
        nodes.append(Node(n.op, n.dtype, args))
    tensors = [tracer.tensors[i] for i in sorted(slots, key=slots.get)]
    types = tuple((str(t.dtype).replace("torch.", ""), t.dim()) for t in tensors)
    return Graph(tracer.kind, tuple(nodes), tuple(tensors), types)


def trace(kind: str, fn, allow_cpu: bool) -> Graph:
    """Run ``fn`` once on traced inputs and return the graph of its result (``kind``: "score" or "mask")."""
    tracer = _Tracer(kind, allow_cpu)
    names = INPUTS if kind == "score" else INPUTS[1:]
    out = fn(*(Sym(tracer, tracer.node("in", "f32" if n == "score" else "i32", (n,))) for n in names))
    want = "f32" if kind == "score" else "bool"
    if isinstance(out, Sym) and out.tracer is tracer:
        if out.node.dtype != want:
            tracer.fail(f"returned a{'n int' if out.node.dtype == 'i32' else ' ' + out.node.dtype} value; "
                        + ("a score_mod returns a float (cast with .float())" if kind == "score" else
                           "a mask_mod returns a bool (a comparison)"))
        root = out.node
    elif kind == "score" and isinstance(out, (int, float)) and not isinstance(out, bool):
        root = tracer.const(out, "f32")
    elif kind == "mask" and isinstance(out, bool):
        root = tracer.const(out, "bool")
    else:
        tracer.fail(f"must return a traced {'float' if kind == 'score' else 'bool'} value or a constant, "
                    f"got {type(out).__name__}")
    return _finish(tracer, root)
