"""A traced mod as data: its nodes, canonical hash, CUDA printer and torch evaluator (the semantics are
the package's docstring's). No torch at import: the evaluator imports it."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field

INPUTS = ("score", "b", "h", "q", "kv")
MAX_CAPTURES = 4
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


class ModError(ValueError):
    """A score_mod or mask_mod flashgen cannot trace or run: the message names the operation."""


class UnknownModError(ModError, KeyError):
    """A mod token that this process has not registered."""

    def __str__(self):
        return ValueError.__str__(self)


@dataclass(frozen=True)
class Node:
    """One operation: ``op``, result type (f32, i32, bool) and args: earlier nodes' positions, except for
    ``const`` (the value), ``in`` (an input's name) and ``load`` (the capture's slot, then the indices)."""

    op: str
    dtype: str
    args: tuple


def const_text(dtype: str, value) -> str:
    """A constant as the hash and the interning see it: floats exactly (hex), ints and bools by value."""
    return f"f:{float(value).hex()}" if dtype == "f32" else f"{dtype[0]}:{int(value)}"


CTYPES = {"f32": "float", "i32": "int", "bool": "bool"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_C_WORDS = frozenset("""auto bool break case char const continue default do double else enum extern float for goto if
inline int long register return short signed sizeof static struct switch typedef union unsigned void volatile while
class namespace template typename this true false new delete operator""".split())
HEADS = {"score": "FG_DEVICE float {}(float score, int b, int h, int q, int kv, const fg_mod_args& a)",
         "mask": "FG_DEVICE bool {}(int b, int h, int q, int kv, const fg_mod_args& a)"}


@dataclass(frozen=True, eq=False)
class Graph:
    """A traced mod: ``nodes`` in dependency order (the last is the result), ``captures`` the tensors it
    reads (slot order: first use in ``nodes``, whose order is canonical, not the source's), ``capture_types``
    their (dtype name, ndim). ``uses`` are the inputs it reads; ``hash`` is the sha256 of its canonical form
    (nodes, ops, exact constants, capture dtypes and ndims), which two spellings of one mod share and no
    capture's values, shape or identity enter."""

    kind: str
    nodes: tuple
    captures: tuple
    capture_types: tuple
    uses: frozenset = field(init=False)
    hash: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "uses", frozenset(n.args[0] for n in self.nodes if n.op == "in"))
        rows = [[n.op, n.dtype, *([const_text(n.dtype, n.args[0])] if n.op == "const" else n.args)]
                for n in self.nodes]
        text = json.dumps({"format": "flashgen-mod-1", "kind": self.kind,
                           "captures": [list(c) for c in self.capture_types], "nodes": rows}, separators=(",", ":"))
        object.__setattr__(self, "hash", hashlib.sha256(text.encode()).hexdigest())

    def factors(self) -> tuple[float, float]:
        """(k, c): a score_mod of the form ``c * f(k * score, ...)`` with constants k != 0 (every use of the
        score is a multiply or divide by one constant) and c > 0 (the result is a multiply by it); 1.0
        where the form does not hold. A kernel folds both into the scales it applies anyway (k into the
        softmax scale it multiplies the raw score by, c into the softmax's exp2 factor and its LSE), as it
        does for the built-in softcap: ``cuda(fold=True)`` prints f alone."""
        if self.kind != "score":
            return 1.0, 1.0
        k, _, c, _ = self._folds()
        return k, c

    def _folds(self) -> tuple:
        """(k, the k * score nodes, c, f's position or None): ``factors`` and what ``cuda(fold=True)`` drops.
        A result that is itself k * score keeps its multiply in k (s * 2: k = 2, c = 1)."""
        k, scaled = self._in_factor()
        c, inner = self._out_factor()
        if len(self.nodes) - 1 in scaled:
            c, inner = 1.0, None
        return k, scaled, c, inner

    def _in_factor(self) -> tuple[float, tuple]:
        """(k, the positions of the nodes that are k * score), or (1.0, ())."""
        at = next((i for i, n in enumerate(self.nodes) if n.op == "in" and n.args[0] == "score"), None)
        users = [i for i, n in enumerate(self.nodes)
                 if at is not None and n.op not in ("const", "in", "load") and at in n.args]
        ks = set()
        for i in users:
            n = self.nodes[i]
            if n.op not in ("mul", "div") or (n.op == "div" and n.args[0] != at):
                return 1.0, ()
            other = self.nodes[n.args[1] if n.args[0] == at else n.args[0]]
            if other.op != "const":
                return 1.0, ()
            value = float(other.args[0])
            if not (math.isfinite(value) and value != 0 and (n.op == "mul" or _reciprocal_fits(value))):
                return 1.0, ()
            ks.add(value if n.op == "mul" else 1.0 / value)
        return (ks.pop(), tuple(users)) if len(ks) == 1 else (1.0, ())

    def _out_factor(self) -> tuple[float, int | None]:
        """(c, the position of f), or (1.0, None)."""
        last = self.nodes[-1]
        if last.op != "mul" or len(self.nodes) < 2:
            return 1.0, None
        for mine, other in ((0, 1), (1, 0)):
            c = self.nodes[last.args[mine]]
            if c.op == "const" and self.nodes[last.args[other]].op != "const":
                value = float(c.args[0])
                if math.isfinite(value) and 2.0 ** -126 <= value < 2.0 ** 127:
                    return value, last.args[other]
        return 1.0, None

    def inner(self) -> "Graph":
        """f of a score_mod ``c * f(k * score)`` (``factors``) as a graph of its own, its score input being
        k * score: what ``cuda(fold=True)`` prints; the graph itself where nothing folds."""
        if self.kind != "score":
            return self
        _, scaled, _, inner = self._folds()
        if not scaled and inner is None:
            return self
        end = len(self.nodes) if inner is None else inner + 1
        nodes = tuple(Node("in", "f32", ("score",)) if i in scaled else n for i, n in enumerate(self.nodes[:end]))
        return Graph(self.kind, nodes, self.captures, self.capture_types)

    def cuda(self, fname: str, slot0: int = 0, fold: bool = False) -> str:
        """The graph as one straight-line device function named ``fname`` (a C identifier), reading its
        capture i as slot ``slot0 + i`` of ``fg_mod_args`` (the kernel header defines it, ``FG_DEVICE``
        and ``fg_clampi``). ``fold``: a score_mod's ``factors`` are left to the caller (its score argument
        is k * score, its result is f, not c * f)."""
        self._check_print(fname, slot0)
        scaled, result = (), len(self.nodes) - 1
        if fold and self.kind == "score":
            _, scaled, _, inner = self._folds()
            result = result if inner is None else inner
        lines = [HEADS[self.kind].format(fname) + " {"]
        for i, n in enumerate(self.nodes[:result + 1]):
            expr = "score" if i in scaled else self._expr(n, slot0)
            lines.append(f"    const {CTYPES[n.dtype]} v{i} = {expr};")
        lines += [f"    return v{result};", "}", ""]
        return "\n".join(lines)

    def _check_print(self, fname, slot0: int = 0) -> None:
        """``ModError`` unless ``fname`` is a C identifier and the captures fit ``fg_mod_args`` from ``slot0``."""
        if not isinstance(fname, str) or not _IDENT.match(fname) or fname in _C_WORDS:
            raise ModError(f"the device function name {fname!r} is not a C identifier")
        if type(slot0) is not int or slot0 < 0 or slot0 + len(self.captures) > MAX_CAPTURES:
            raise ModError(f"captures at slots {slot0}..{slot0 + len(self.captures) - 1} do not fit the "
                           f"{MAX_CAPTURES} slots of fg_mod_args")

    @functools.cached_property
    def per_head(self) -> frozenset:
        """Positions of the nodes whose value depends on neither the score nor q nor kv: b, h, constants, and
        arithmetic and captured-tensor reads over those (``off[0]``, ``prefix[b]``, ``slope[h]``)."""
        fixed = set()
        for i, n in enumerate(self.nodes):
            if n.op == "in":
                if n.args[0] in ("b", "h"):
                    fixed.add(i)
            elif n.op == "const" or all(a in fixed for a in (n.args[1:] if n.op == "load" else n.args)):
                fixed.add(i)
        return frozenset(fixed)

    def hoisted(self) -> tuple:
        """The per-head nodes (``per_head``) a kernel computes once per (batch, head) and keeps: each that is not a
        constant or an input and that a per-score node (or the result) reads."""
        fixed, last = self.per_head, len(self.nodes) - 1
        used = {a for i, n in enumerate(self.nodes) if i not in fixed and n.op not in ("const", "in")
                for a in (n.args[1:] if n.op == "load" else n.args)}
        return tuple(i for i in sorted(fixed & (used | {last})) if self.nodes[i].op not in ("const", "in"))

    def loads_per_score(self) -> bool:
        """Whether the graph reads a captured tensor at an index that depends on q, kv or the score (document ids
        ``doc[q]``): reads at per-head indices (``per_head``) are not, a kernel makes them once per head."""
        fixed = self.per_head
        return any(n.op == "load" and i not in fixed for i, n in enumerate(self.nodes))

    def cuda_hoisted(self, fname: str, slot0: int = 0) -> str:
        """The graph as three device functions: ``{fname}_head(b, h, a)``, the ``hoisted`` nodes in a struct
        ``{fname}_head_t`` (empty where there are none); ``fname`` with that struct as a last argument, the
        per-score rest; and ``fname`` of the usual arguments, the two together. A kernel calls the head once
        per (batch, head): a read at a constant or per-head index is then one load per head, where the
        compiler would repeat it per score (a wgmma's memory clobber between blocks keeps it in the loop)."""
        self._check_print(fname, slot0)
        if self.kind != "mask":
            raise ModError("cuda_hoisted prints a mask_mod")
        fixed, keep = self.per_head, self.hoisted()
        struct, head = f"{fname}_head_t", f"{fname}_head"
        lines = [f"struct {struct} {{" + "".join(f" {CTYPES[self.nodes[i].dtype]} v{i};" for i in keep) + " };",
                 f"FG_DEVICE {struct} {head}(int b, int h, const fg_mod_args& a) {{"]
        lines += [f"    const {CTYPES[n.dtype]} v{i} = {self._expr(n, slot0)};"
                  for i, n in enumerate(self.nodes) if i in fixed and i <= max(keep, default=-1)]
        lines += ["    return {" + ", ".join(f"v{i}" for i in keep) + "};", "}",
                  HEADS[self.kind].format(fname)[:-1] + f", const {struct}& k) {{"]
        for i, n in enumerate(self.nodes):
            if i in keep:
                lines.append(f"    const {CTYPES[n.dtype]} v{i} = k.v{i};")
            elif i not in fixed or n.op in ("const", "in"):
                lines.append(f"    const {CTYPES[n.dtype]} v{i} = {self._expr(n, slot0)};")
        lines += [f"    return v{len(self.nodes) - 1};", "}",
                  HEADS[self.kind].format(fname) + " {",
                  f"    return {fname}(b, h, q, kv, a, {head}(b, h, a));", "}", ""]
        return "\n".join(lines)

    def cuda_with_value(self, fname: str, value: int) -> str:
        """A derivative graph (``mods.derivative``: the score_mod's nodes first) as one device function that
        returns node ``value`` (the score_mod's result) and writes this graph's result (the derivative) to
        its last argument, ``float& grad``: the nodes both need are computed once (a softcap's tanh)."""
        if self.kind != "score" or type(value) is not int or not 0 <= value < len(self.nodes):
            raise ModError(f"cuda_with_value takes a score graph and one of its node positions, got {value!r}")
        self._check_print(fname)
        lines = [HEADS["score"].format(fname)[:-1] + ", float& grad) {"]
        for i, n in enumerate(self.nodes):
            lines.append(f"    const {CTYPES[n.dtype]} v{i} = {self._expr(n, 0)};")
        lines += [f"    grad = v{len(self.nodes) - 1};", f"    return v{value};", "}", ""]
        return "\n".join(lines)

    def constant(self):
        """The value of a graph whose result is a constant (through additions of a constant 0, as
        ``derivative`` ends), else None."""
        i = len(self.nodes) - 1
        while True:
            n = self.nodes[i]
            if n.op == "const":
                return n.args[0]
            if n.op != "add":
                return None
            zero = [a for a in n.args if self.nodes[a].op == "const" and self.nodes[a].args[0] == 0]
            if not zero:
                return None
            i = n.args[1] if n.args[0] == zero[0] else n.args[0]

    def evaluate(self, score, b, h, q, kv):
        """The graph on torch values, with the printed CUDA's semantics: ``score`` as float32, the indices
        as int32 (each a Python number or a tensor; they broadcast; an input the graph does not use may
        be None). Returns a tensor of the inputs' broadcast shape, on the first tensor input's device
        (else the first capture's)."""
        import torch

        given = dict(zip(INPUTS, (score, b, h, q, kv)))
        shapes = [v.shape for v in given.values() if isinstance(v, torch.Tensor)]
        device = next((v.device for v in given.values() if isinstance(v, torch.Tensor)),
                      self.captures[0].device if self.captures else torch.device("cpu"))
        dtypes = {"f32": torch.float32, "i32": torch.int32, "bool": torch.bool}
        vals = []
        for n in self.nodes:
            if n.op == "in":
                if given[n.args[0]] is None:
                    raise ValueError(f"this mod reads {n.args[0]}, which was passed as None")
                out = torch.as_tensor(given[n.args[0]], dtype=dtypes[n.dtype], device=device)
            elif n.op == "const":
                out = torch.tensor(n.args[0], dtype=dtypes[n.dtype], device=device)
            elif n.op == "load":
                t = self.captures[n.args[0]].to(device)
                index = [torch.clamp(vals[x], 0, t.shape[d] - 1).long() for d, x in enumerate(n.args[1:])]
                out = t[tuple(torch.broadcast_tensors(*index))].to(dtypes[n.dtype])
            else:
                out = _eval(torch, n, [vals[a] for a in n.args])
            vals.append(out)
        result = vals[-1]
        return result.expand(torch.broadcast_shapes(result.shape, *shapes))

    def _expr(self, n: Node, slot0: int) -> str:
        op, t = n.op, n.dtype
        if op == "in":
            return n.args[0]
        if op == "const":
            return _c_const(t, n.args[0])
        if op == "load":
            k = slot0 + n.args[0]
            off = " + ".join(f"(long long)fg_clampi(v{x}, a.n[{k}][{d}]) * a.s[{k}][{d}]"
                             for d, x in enumerate(n.args[1:]))
            return _C_LOAD[self.capture_types[n.args[0]][0]].format(t=f"a.t[{k}]", off=off)
        v = [f"v{a}" for a in n.args]
        if op == "cast":
            src = self.nodes[n.args[0]].dtype
            if src == "bool":
                return f"({v[0]} ? 1.0f : 0.0f)" if t == "f32" else f"({v[0]} ? 1 : 0)"
            return f"(float){v[0]}" if t == "f32" else f"__float2int_rz({v[0]})"
        divisor = self.nodes[n.args[1]] if op == "div" else None
        if divisor is not None and divisor.op == "const" and _reciprocal_fits(divisor.args[0]):
            return f"__fmul_rn({v[0]}, {_c_const('f32', 1.0 / divisor.args[0])})"  # x / c as x (1/c)
        form = (_C_FLOAT if t == "f32" else _C_INT).get(op) or _C_ANY[op]
        return form.format(*v)


class Builder:
    """A node list grown from a graph's: the original nodes first (their positions kept), then the new
    ones, each distinct node once (the derivative's, the linear form's coefficients)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)
        self.seen = {(n.op, n.dtype, n.args): i for i, n in enumerate(nodes)}

    def add(self, op: str, *args, dtype: str = "f32") -> int:
        key = (op, dtype, tuple(args))
        if key not in self.seen:
            self.seen[key] = len(self.nodes)
            self.nodes.append(Node(op, dtype, tuple(args)))
        return self.seen[key]

    def const(self, value: float) -> int:
        return self.add("const", float(value))

    # Arithmetic that skips a zero (None) term.
    def plus(self, a, b):
        return b if a is None else a if b is None else self.add("add", a, b)

    def minus(self, a, b):
        return a if b is None else self.add("neg", b) if a is None else self.add("sub", a, b)

    def times(self, a, b):
        return None if a is None or b is None else self.add("mul", a, b)

    def over(self, a, b):
        return None if a is None else self.add("div", a, b)

    def graph(self, like: Graph, result: int) -> Graph:
        """A graph of ``like``'s kind and captures whose result is node ``result`` (an f32 node): a graph's
        result is its last node, so it ends on a copy of it where it is not."""
        if result != len(self.nodes) - 1:
            self.nodes.append(Node("add", "f32", (result, self.const(0.0))))
        return Graph(like.kind, tuple(self.nodes), like.captures, like.capture_types)


# Loads by capture dtype. The kernels include no CUDA header (NVRTC has no include path), so 16-bit floats
# are read as their bits: bfloat16 is the high half of a float32, float16 goes through PTX's cvt.
_C_LOAD = {"float32": "__ldg(reinterpret_cast<const float*>({t}) + ({off}))",
           "float16": "[](unsigned short x) {{ float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(x)); "
                      "return f; }}(reinterpret_cast<const unsigned short*>({t})[{off}])",
           "bfloat16": "__uint_as_float((unsigned)reinterpret_cast<const unsigned short*>({t})[{off}] << 16)",
           "int32": "__ldg(reinterpret_cast<const int*>({t}) + ({off}))",
           "int64": "(int)__ldg(reinterpret_cast<const long long*>({t}) + ({off}))",
           "bool": "(reinterpret_cast<const unsigned char*>({t})[{off}] != 0)"}
# Float arithmetic: + - * rounded as torch's (no FMA contraction); / and the functions through the
# hardware's approximations (templates/common/: rcp, ex2, lg2, tanh, sqrt, rsqrt .approx), as
# the kernels' own softmax and softcap use them: the exact forms (div.rn, expf, tanhf) are instruction
# sequences that cost a softcap mod 2.7x its built-in twin's time, for a relative error (rcp, ex2, lg2,
# sqrt: a few 2^-23; tanh: 2^-11) far below the bf16 rounding of the scores' use. // and % on floats
# stay exact (their floor needs it). ``Graph.evaluate`` computes exactly.
_C_FLOAT = {"add": "__fadd_rn({0}, {1})", "sub": "__fsub_rn({0}, {1})", "mul": "__fmul_rn({0}, {1})",
            "div": "__fmul_rn({0}, fg_rcp({1}))", "floordiv": "floorf(__fdiv_rn({0}, {1}))",
            "mod": "((fmodf({0}, {1}) != 0.0f && ((fmodf({0}, {1}) < 0.0f) != ({1} < 0.0f))) "
                   "? __fadd_rn(fmodf({0}, {1}), {1}) : fmodf({0}, {1}))",
            "neg": "(-{0})", "abs": "fabsf({0})", "min": "fminf({0}, {1})", "max": "fmaxf({0}, {1})",
            "exp": "fast_exp2(__fmul_rn({0}, 0x1.715476p+0f))", "exp2": "fast_exp2({0})",
            "log": "__fmul_rn(fg_lg2({0}), 0x1.62e43p-1f)", "log2": "fg_lg2({0})",
            "tanh": "fast_tanh({0})", "sqrt": "fg_sqrt({0})", "rsqrt": "fg_rsqrt({0})",
            "sigmoid": "fg_rcp(__fadd_rn(1.0f, fast_exp2(__fmul_rn({0}, -0x1.715476p+0f))))"}
# int32 arithmetic wraps (through unsigned, as torch's does); // and % take Python's floor, x / 0 and x % 0
# give 0, and a divisor of -1 is handled apart (INT_MIN / -1 overflows C's division).
_C_INT = {"add": "(int)((unsigned){0} + (unsigned){1})", "sub": "(int)((unsigned){0} - (unsigned){1})",
          "mul": "(int)((unsigned){0} * (unsigned){1})", "neg": "(int)(0u - (unsigned){0})",
          "abs": "({0} < 0 ? (int)(0u - (unsigned){0}) : {0})",
          "floordiv": "({1} == 0 ? 0 : {1} == -1 ? (int)(0u - (unsigned){0}) : "
                      "{0} / {1} - (({0} % {1} != 0) && (({0} % {1} < 0) != ({1} < 0))))",
          "mod": "(({1} == 0 || {1} == -1) ? 0 : ({0} % {1} != 0 && (({0} % {1} < 0) != ({1} < 0))) "
                 "? {0} % {1} + {1} : {0} % {1})",
          "min": "min({0}, {1})", "max": "max({0}, {1})"}
_C_ANY = {"lt": "({0} < {1})", "le": "({0} <= {1})", "eq": "({0} == {1})", "ne": "({0} != {1})",
          "and": "({0} && {1})", "or": "({0} || {1})", "not": "(!{0})", "where": "({0} ? {1} : {2})"}


def _eval(torch, n: Node, v: list):
    """One operation on torch tensors, as _C_FLOAT/_C_INT/_C_ANY print it."""
    op, t = n.op, n.dtype
    if op == "cast":
        x = v[0]
        if t == "f32" or x.dtype == torch.bool:
            return x.to(torch.float32 if t == "f32" else torch.int32)
        big, small = x >= 2.0 ** 31, x <= -2.0 ** 31  # __float2int_rz: saturates, NaN gives 0
        inner = torch.where(big | small | torch.isnan(x), torch.zeros_like(x), x).to(torch.int32)
        return torch.where(big, INT32_MAX, torch.where(small, INT32_MIN, inner)).to(torch.int32)
    if op in ("floordiv", "mod") and t == "i32":
        x, y = v
        odd = (y == 0) | (y == -1)
        safe = torch.where(odd, torch.ones_like(y), y)
        if op == "mod":
            return torch.where(odd, torch.zeros_like(x), torch.remainder(x, safe))
        r = torch.div(x, safe, rounding_mode="floor")
        return torch.where(y == 0, torch.zeros_like(r), torch.where(y == -1, torch.neg(x), r))
    if op == "floordiv":
        return torch.floor(torch.div(*v))
    if op == "mod":
        r = torch.fmod(*v)
        return torch.where((r != 0) & ((r < 0) != (v[1] < 0)), r + v[1], r)
    if op in ("min", "max"):
        pick = {"min": torch.fmin, "max": torch.fmax} if t == "f32" else {"min": torch.minimum, "max": torch.maximum}
        return pick[op](*v)
    if op == "where":
        return torch.where(*v)
    names = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "neg": "neg", "abs": "abs", "lt": "lt",
             "le": "le", "eq": "eq", "ne": "ne", "and": "logical_and", "or": "logical_or", "not": "logical_not"}
    return getattr(torch, names.get(op, op))(*v)


def _reciprocal_fits(c) -> bool:
    """Whether 1 / c is a finite, normal float32 (a constant divisor printed as a multiply)."""
    return isinstance(c, (int, float)) and c != 0 and math.isfinite(c) and 2.0 ** -126 <= abs(1.0 / c) < 2.0 ** 127


def _c_const(dtype: str, value) -> str:
    """A constant as C: bools and ints as written (INT_MIN as an expression), floats rounded to float32
    and printed exactly as a hex literal."""
    if dtype == "bool":
        return "true" if value else "false"
    if dtype == "i32":
        return "(-2147483647 - 1)" if value == INT32_MIN else f"({value})" if value < 0 else str(value)
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    f32 = struct.unpack("<f", struct.pack("<f", value))[0]
    mantissa, exponent = f32.hex().split("p")
    text = f"{mantissa.rstrip('0').rstrip('.')}p{exponent}f"
    return f"({text})" if text.startswith("-") else text


def passthrough_cuda(kind: str, fname: str) -> str:
    """The device function of a missing half of a pair: the score unchanged, or every key visible (a mask with
    ``Graph.cuda_hoisted``'s head and struct, both empty)."""
    if kind == "score":
        return HEADS[kind].format(fname) + " {\n    return score;\n}\n"
    return (f"struct {fname}_head_t {{ }};\nFG_DEVICE {fname}_head_t {fname}_head(int, int, const fg_mod_args&) "
            f"{{ return {{}}; }}\n" + HEADS[kind].format(fname)[:-1] + f", const {fname}_head_t&) {{ return true; }}\n"
            + HEADS[kind].format(fname) + " {\n    return true;\n}\n")
