"""Option parsing the suites share: every check raises ValueError naming the option, before any GPU work.

The CLI turns a ValueError from a suite into one line (``flashgen: error: ...``)
and exit status 2, so each function here says which option was wrong and what
it takes.
"""
from __future__ import annotations

CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,)}


def ints(text: str, what: str, positive: bool = True) -> list[int]:
    """Comma-separated integers of option ``--what``."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated integers, got {text!r}") from None
    if not values:
        raise ValueError(f"--{what} takes comma-separated integers, got {text!r}")
    if positive and any(v <= 0 for v in values):
        raise ValueError(f"--{what} takes positive integers, got {text!r}")
    return values


def head_dims(text: str, what: str = "d", allowed=None) -> list[int]:
    """Head dims: multiples of 8 up to 256 (``allowed``: only those)."""
    values = ints(text, what)
    for d in values:
        if d % 8 or d > 256:
            raise ValueError(f"--{what} {d}: head dims are multiples of 8 up to 256")
        if allowed is not None and d not in allowed:
            raise ValueError(f"--{what} {d}: this suite has head dims {', '.join(map(str, allowed))}")
    return values


def names(text: str, known, what: str) -> list[str]:
    """A comma-separated subset of ``known``, in the order given, each once."""
    out = []
    for x in str(text).split(","):
        x = x.strip()
        if x and x not in out:
            out.append(x)
    unknown = [x for x in out if x not in known]
    if unknown or not out:
        raise ValueError(f"--{what}: unknown {', '.join(unknown) if unknown else '(empty list)'}; "
                         f"known: {', '.join(known)}")
    return out


def positive(value, what: str, integer: bool = False):
    if value is None or value <= 0 or (integer and int(value) != value):
        kind = "a positive integer" if integer else "positive"
        raise ValueError(f"--{what} must be {kind}, got {value}")
    return value


def shapes(text: str, what: str, fields: tuple, optional: tuple = ()) -> list[tuple]:
    """``"a,b,c;a,b,c"``: one tuple of positive ints per ';'-separated shape; ``fields`` name the required
    ones (for the message), ``optional`` the (name, default) pairs that may follow them."""
    out = []
    parts = [p.strip() for p in str(text).split(";") if p.strip()]
    if not parts:
        raise ValueError(f"--{what} takes shapes \"{','.join(fields)};...\", got {text!r}")
    for part in parts:
        try:
            values = [int(x) for x in part.split(",")]
        except ValueError:
            values = None
        if values is None or not len(fields) <= len(values) <= len(fields) + len(optional):
            spelled = ",".join(fields) + "".join(f"[,{n}]" for n, _ in optional)
            raise ValueError(f"--{what}: {part!r} is not {spelled} (integers)")
        if any(v <= 0 for v in values[:len(fields)]) or any(v < 0 for v in values[len(fields):]):
            raise ValueError(f"--{what}: {part!r}: sizes must be positive")
        values += [default for _, default in optional[len(values) - len(fields):]]
        out.append(tuple(values))
    return out


def dtype_of(name: str):
    """The torch dtype of ``--dtype`` (bf16, fp16); imports torch."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
