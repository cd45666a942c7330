"""Score_mods that are a bias linear in the key index: ``f(x, b, h, q, kv) = x + a(b, h) kv + r(b, h, q)``
(x the score after ``Graph.factors``' fold). ALiBi written as FlexAttention writes it (``score + slope[h] *
(kv_idx - q_idx)``) is one, and so is ``score - slope[h] * |q_idx - kv_idx|`` under a mask that shows a
query only the keys at or before it (``q_idx >= kv_idx`` among the mask's conjuncts, or ``q_idx + off >=
kv_idx`` with ``|q_idx + off - kv_idx|``): on what that mask lets through ``|q - kv|`` is ``q - kv``.

Such a mod needs no per-score function in ``fwd_sm90``: the kernel adds ``a kv`` to the raw scores with
one FMA and an immediate per score, and moves what a row's scores share in a block (``a c0 + r(q)``, c0 the
thread's first key of the block) into the softmax's max and exp2 offset, as the built-in causal ALiBi does
(``common/variant.cuh``'s ALIBI_LINEAR). ``linear_form`` gives what the kernel evaluates: ``a`` as a graph
of its own (built symbolically: a difference of two evaluations of f would lose a's low bits to a large
offset in r), ``r`` as ``f`` (with the ``|.|`` rewritten) at x = 0 and kv = 0 and, where r is itself
linear in q, its coefficient ``beta(b, h)`` (then r(q) = beta q + r(0) costs the kernel an FMA per row and
block, and no call of f).

The test is structural: every node that depends on the score or on kv must be a sum, difference or
negation of such nodes and of nodes free of both, a product or quotient with a value that depends on
neither q, kv nor the score (a constant where the score is involved), or an int-to-float cast; the
result must hold the score with coefficient exactly 1. Integer wrap-around is not modelled (indices and
their differences stay far inside int32).
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Builder, Graph, Node

_VARYING = ("score", "q", "kv")


def _bounds(mask: Graph | None) -> list:
    """The nodes E of ``mask`` (positions) such that the mask shows a key only where ``kv_idx <= E``: the
    right sides of its ``&`` conjuncts ``E >= kv_idx`` or ``E > kv_idx`` (traced as ``kv <= E``, ``kv < E``).
    E is ``q_idx`` for a causal mask, ``q_idx + offset`` for one aligned at the bottom right."""
    if mask is None:
        return []
    nodes, out, todo = mask.nodes, [], [len(mask.nodes) - 1]
    while todo:
        n = nodes[todo.pop()]
        if n.op == "and":
            todo += list(n.args)
        elif n.op in ("le", "lt") and nodes[n.args[0]].op == "in" and nodes[n.args[0]].args[0] == "kv":
            out.append(n.args[1])
    return out


def _same(ga: Graph, i: int, gb: Graph, j: int) -> bool:
    """Whether node i of ``ga`` and node j of ``gb`` compute the same value: the same operations on the same
    inputs, constants and captured tensors (the same memory, read at the same indices)."""
    a, b = ga.nodes[i], gb.nodes[j]
    if (a.op, a.dtype, len(a.args)) != (b.op, b.dtype, len(b.args)):
        return False
    if a.op in ("in", "const"):
        return a.args == b.args
    if a.op == "load":
        return (_same_tensor(ga.captures[a.args[0]], gb.captures[b.args[0]])
                and all(_same(ga, x, gb, y) for x, y in zip(a.args[1:], b.args[1:])))
    return all(_same(ga, x, gb, y) for x, y in zip(a.args, b.args))


def _same_tensor(x, y) -> bool:
    """Whether two captures read the same memory the same way (two traces' views of one tensor are
    different objects)."""
    return x is y or (x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.device == y.device
                      and tuple(x.shape) == tuple(y.shape) and x.stride() == y.stride())


def _without_abs(graph: Graph, mask: Graph | None) -> Graph:
    """``graph`` with each ``|E - kv|`` or ``|kv - E|`` replaced by ``E - kv``, for the E of ``_bounds(mask)``
    (on what the mask shows, E - kv >= 0)."""
    bounds = _bounds(mask)
    nodes = list(graph.nodes)
    kv = next((i for i, n in enumerate(nodes) if n.op == "in" and n.args[0] == "kv"), None)
    if kv is None or not bounds:
        return graph
    changed = False
    for i, n in enumerate(nodes):
        x = nodes[n.args[0]] if n.op == "abs" else None
        if x is None or x.op != "sub" or kv not in x.args:
            continue
        other = x.args[1] if x.args[0] == kv else x.args[0]
        if other != kv and any(_same(graph, other, mask, e) for e in bounds):
            nodes[i] = Node("sub", x.dtype, (other, kv))
            changed = True
    return Graph(graph.kind, tuple(nodes), graph.captures, graph.capture_types) if changed else graph


@dataclass(frozen=True)
class LinearForm:
    """A score_mod's linear form: ``f`` (the folded score_mod with ``|.|`` rewritten; at x = 0, kv = 0 it is
    r(q)), ``kv_coef`` (a graph giving a(b, h)) and ``q_coef`` (one giving beta(b, h) where r is linear in q,
    else None). Each reads the score_mod's captures in the same slots and takes the same arguments."""

    f: Graph
    kv_coef: Graph
    q_coef: Graph | None


_OTHER = object()  # a coefficient that is not an invariant: r's part in q when r is not linear in q


def _analyse(graph: Graph) -> LinearForm | None:
    """``graph``'s linear form, or None (see the module's docstring)."""
    nodes = graph.nodes
    out = Builder(nodes)
    deps: list = []  # the varying inputs (score, q, kv) each node depends on
    forms: list = []  # (score coefficient: float, kv coefficient, q coefficient); None leaves the form
    for n in nodes:
        if n.op in ("in", "const"):
            name = n.args[0] if n.op == "in" else None
            deps.append(frozenset([name]) if name in _VARYING else frozenset())
            forms.append((1.0 if name == "score" else 0.0, out.const(1.0) if name == "kv" else None,
                          out.const(1.0) if name == "q" else None))
            continue
        refs = n.args[1:] if n.op == "load" else n.args
        dep = frozenset().union(*(deps[a] for a in refs)) if refs else frozenset()
        deps.append(dep)
        if not dep:
            forms.append((0.0, None, None))
        elif dep == {"q"}:  # a function of (b, h, q): linear in q, or not
            step = _step(n, nodes, deps, forms, out)
            forms.append(step if step is not None else (0.0, None, _OTHER))
        else:
            forms.append(_step(n, nodes, deps, forms, out))
    last = forms[-1]
    if last is None or last[0] != 1.0:
        return None
    kv_coef = out.graph(graph, last[1] if last[1] is not None else out.const(0.0))
    q_coef = None
    if last[2] is not _OTHER:
        q_coef = out.graph(graph, last[2] if last[2] is not None else out.const(0.0))
    return LinearForm(graph, kv_coef, q_coef)


def _step(n: Node, nodes, deps, forms, out: Builder):
    """Node ``n``'s (score, kv, q) coefficients from its arguments', or None where ``n`` leaves the form."""
    a = n.args
    if n.op in ("add", "sub", "neg"):
        if any(forms[x] is None for x in a):
            return None
        fx = forms[a[0]]
        fy = forms[a[1]] if len(a) > 1 else (0.0, None, None)
        if n.op == "neg":
            fx, fy = (0.0, None, None), fx
        sign = 1.0 if n.op == "add" else -1.0
        combine = out.plus if n.op == "add" else out.minus
        q_part = _OTHER if _OTHER in (fx[2], fy[2]) else combine(fx[2], fy[2])
        return fx[0] + sign * fy[0], combine(fx[1], fy[1]), q_part
    if n.op == "cast":
        return forms[a[0]] if nodes[a[0]].dtype == "i32" and n.dtype == "f32" else None
    if n.op in ("mul", "div"):
        moving = [x for x in a if deps[x]]
        if len(moving) != 1 or (n.op == "div" and moving[0] != a[0]) or forms[moving[0]] is None:
            return None
        fx = forms[moving[0]]
        other = a[1] if moving[0] == a[0] else a[0]
        factor = other if nodes[other].dtype == "f32" else out.add("cast", other)
        c = 0.0
        if fx[0] != 0.0:  # the score's coefficient must stay a constant
            if nodes[other].op != "const" or float(nodes[other].args[0]) == 0.0:
                return None
            value = float(nodes[other].args[0])
            c = fx[0] * value if n.op == "mul" else fx[0] / value
        scale = out.times if n.op == "mul" else out.over
        q_part = _OTHER if fx[2] is _OTHER else scale(fx[2], factor)
        return c, scale(fx[1], factor), q_part
    return None


def linear_form(score: Graph | None, mask: Graph | None) -> LinearForm | None:
    """A score_mod's linear form (with ``|q - kv|`` rewritten where ``mask`` orders the keys), or None where
    the score_mod does not have it."""
    if score is None:
        return None
    return _analyse(_without_abs(score.inner(), mask))
