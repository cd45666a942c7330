"""The derivative of a traced score_mod with respect to its score: another ``Graph`` of the same
captures, built by forward-mode differentiation over the node list (what a backward kernel needs to
turn dP into the gradient of the raw score: dS = P (dP - D) * d score_mod / d score).

Only f32 values carry a derivative; integers, bools, constants and reads of captured tensors have
none with respect to the score. The rules are calculus's, with torch's conventions where a function
has a kink: ``abs`` takes the sign (0 at 0), ``min``/``max`` pass the derivative of the operand they
return (the first one on a tie, as ``fmin``/``fmax`` return it), ``where`` that of the branch it
takes, ``//`` (floor) none, ``%`` that of its dividend (and minus the floored quotient times the
divisor's), a cast from an integer none.
"""
from __future__ import annotations

import math

from .graph import Builder, Graph, ModError, Node


def derivative(graph: Graph) -> Graph:
    """d score_mod / d score as a score graph (``ModError`` for a mask graph)."""
    if graph.kind != "score":
        raise ModError("only a score_mod has a derivative with respect to the score")
    nodes = graph.nodes
    out = Builder(nodes)
    d: list = []  # d[i]: the position of node i's derivative, None where it is 0
    for i, n in enumerate(nodes):
        d.append(None if n.dtype != "f32" else _rule(out, i, n, nodes, d))
    return out.graph(graph, d[-1] if d[-1] is not None else out.const(0.0))


def _rule(out: Builder, i: int, n: Node, nodes, d):
    op, a = n.op, n.args
    if op == "in":
        return out.const(1.0) if a[0] == "score" else None
    if op in ("const", "load", "cast"):  # (a cast to f32 comes from an int or a bool: no derivative)
        return None
    x = a[0] if op != "where" else None
    dx = d[a[0]] if op != "where" else None
    dy = d[a[1]] if len(a) > 1 else None
    if op == "add":
        return out.plus(dx, dy)
    if op == "sub":
        return out.minus(dx, dy)
    if op == "neg":
        return None if dx is None else out.add("neg", dx)
    if op == "mul":
        return out.plus(out.times(dx, a[1]), out.times(a[0], dy))
    if op == "div":  # (x / y)' = x' / y - (x / y) y' / y
        return out.minus(out.over(dx, a[1]), out.over(out.times(i, dy), a[1]))
    if op == "abs":
        if dx is None:
            return None
        negative = out.add("lt", x, out.const(0.0), dtype="bool")
        positive = out.add("lt", out.const(0.0), x, dtype="bool")
        return out.add("where", negative, out.add("neg", dx), out.add("where", positive, dx, out.const(0.0)))
    if op in ("min", "max"):
        if dx is None and dy is None:
            return None
        first = out.add("le", *((x, a[1]) if op == "min" else (a[1], x)), dtype="bool")  # x is the one returned
        return out.add("where", first, dx if dx is not None else out.const(0.0),
                       dy if dy is not None else out.const(0.0))
    if op == "where":
        dt, df = d[a[1]], d[a[2]]
        if dt is None and df is None:
            return None
        zero = out.const(0.0)
        return out.add("where", a[0], dt if dt is not None else zero, df if df is not None else zero)
    if op == "floordiv":
        return None
    if op == "mod":  # x - floor(x / y) y
        return out.minus(dx, out.times(out.add("floordiv", x, a[1]), dy))
    if dx is None:
        return None
    # One-operand functions: f(x)' = g(x) x'.
    if op == "exp":
        g = i
    elif op == "exp2":
        g = out.add("mul", i, out.const(math.log(2.0)))
    elif op == "log":
        g = out.add("div", out.const(1.0), x)
    elif op == "log2":
        g = out.add("div", out.const(1.0 / math.log(2.0)), x)
    elif op == "tanh":
        g = out.add("sub", out.const(1.0), out.add("mul", i, i))
    elif op == "sqrt":
        g = out.add("div", out.const(0.5), i)
    elif op == "rsqrt":  # (x^-1/2)' = -x^-3/2 / 2
        g = out.add("mul", out.const(-0.5), out.add("div", i, x))
    elif op == "sigmoid":
        g = out.add("mul", i, out.add("sub", out.const(1.0), i))
    else:
        raise ModError(f"score_mod: the operation {op} has no derivative rule")
    return out.add("mul", g, dx)
