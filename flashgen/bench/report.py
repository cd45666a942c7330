"""Print, save and plot a bench result (any suite: see the format in ``flashgen.bench``).

No torch and no GPU needed: plots can be made on any machine from a stored
JSON (``flashgen bench --plot-from results.json --out DIR``). matplotlib is
the ``bench`` extra and is imported only by ``plot``.

Optional parts of a result, each shown by ``table`` when present:
``precision`` (decimals of the metric, default 1), ``ratios`` (labels of
per-row ratios, ``row["ratios"][label]``, shown as columns with 3 decimals),
``fields`` (row fields shown as text columns after x), ``notes`` (lines after
the table), ``sections`` ({name: a result of the same shape}, shown after the
main table: a suite's secondary tables, e.g. decode's paged layouts) and
``plot`` (False: nothing to draw, e.g. ``sass``). The x values may be numbers
(a log2 axis) or names (one tick per name, in first-seen order).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from numbers import Number
from pathlib import Path

_REQUIRED = ("suite", "metric", "x", "panels", "impls", "rows")


def load(path) -> dict:
    """A result read from ``path``; ValueError naming the path when it is not one."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a bench result ({exc})") from None
    missing = [k for k in _REQUIRED if not isinstance(result, dict) or k not in result]
    if missing:
        raise ValueError(f"{path}: not a bench result (missing {', '.join(missing)})")
    return result


def save(result: dict, path) -> Path:
    """Write ``result`` as JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    os.replace(tmp, path)
    return path


def panels(result: dict) -> list[tuple]:
    """The distinct panel keys (values of ``result["panels"]`` fields), in first-seen order."""
    seen = []
    for row in result["rows"]:
        key = tuple(row.get(f) for f in result["panels"])
        if key not in seen:
            seen.append(key)
    return seen


def _title(result, key) -> str:
    return ", ".join(f"{f}={v}" for f, v in zip(result["panels"], key))


def _number(value) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool) and math.isfinite(value)


def _cell_text(cell: dict, metric: str, precision: int) -> str:
    value = cell.get(metric)
    if _number(value):
        return f"{value:.{precision}f}"
    return "skip" if "skipped" in cell else "err" if "error" in cell else "-"


def _columns(result: dict) -> tuple[list, list]:
    """(header, rows of cell texts) of one result's table."""
    metric, precision = result["metric"], int(result.get("precision", 1))
    ratios, fields = list(result.get("ratios") or ()), list(result.get("fields") or ())
    head = [*result["panels"], result["x"] or "", *fields, *result["impls"], *ratios]
    body = []
    for row in result["rows"]:
        cells = [str(row.get(f)) for f in result["panels"]] + [str(row.get(result["x"], ""))]
        cells += [str(row.get(f, "")) for f in fields]
        cells += [_cell_text(row.get("results", {}).get(impl, {}), metric, precision) for impl in result["impls"]]
        for label in ratios:
            value = (row.get("ratios") or {}).get(label)
            cells.append(f"{value:.3f}" if _number(value) else "-")
        body.append(cells)
    return head, body


def _one_table(result: dict) -> list[str]:
    head, body = _columns(result)
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(head)]
    lines = [" ".join(f"{h:>{w}}" for h, w in zip(head, widths)),
             f"  ({result['metric']}; {result.get('convention', '')})"]
    lines += [" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) for cells in body]
    errors = sorted({f"{impl}: {c['error']}" for row in result["rows"]
                     for impl, c in row.get("results", {}).items() if isinstance(c, dict) and "error" in c})
    if errors:
        lines.append("errors:")
        lines += [f"  {e}" for e in errors[:20]]
        if len(errors) > 20:
            lines.append(f"  ... and {len(errors) - 20} more (see the JSON)")
    lines += [str(n) for n in result.get("notes") or ()]
    return lines


def table(result: dict) -> str:
    """The result as text: one line per row, one column per implementation (metric, or '-'/'skip'/'err'),
    then its ratio columns, its errors, its notes, and each section the same way."""
    lines = _one_table(result)
    for name, section in (result.get("sections") or {}).items():
        lines += ["", f"[{name}]"]
        lines += _one_table({"panels": [], "impls": [], "rows": [], "x": "", "metric": "", **section})
    return "\n".join(lines)


def plottable(result: dict) -> str | None:
    """None when ``plot`` can draw ``result``, else why not (no rows, no numeric values, ``plot: false``)."""
    if result.get("plot") is False:
        return f"the {result.get('suite', '?')} result has no plot (its table and JSON hold everything)"
    if not result.get("rows"):
        return "the result has no rows to plot"
    metric = result["metric"]
    if not any(_number(c.get(metric)) for r in result["rows"] for c in r.get("results", {}).values()
               if isinstance(c, dict)):
        return f"the result has no {metric} values to plot"
    return None


def plot(result: dict, out_dir, name: str | None = None) -> dict:
    """One PNG, one panel per panel key, metric against x, one line per implementation (log2 x axis for
    numbers, one tick per name otherwise).

    Returns {"path": the PNG, "panels": the panel titles, "axes": the number of panels drawn}.
    Raises ImportError with the install hint when matplotlib is missing, ValueError when there is
    nothing to draw (``plottable``).
    """
    why = plottable(result)
    if why:
        raise ValueError(why)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'flashgen[bench]' (or plot later from the JSON "
                          "with `flashgen bench --plot-from FILE --out DIR`)") from None
    keys = panels(result)
    x_field, metric = result["x"], result["metric"]
    categorical = not all(_number(r.get(x_field)) for r in result["rows"])
    cols = min(len(keys), 2)
    rows = -(-len(keys) // cols)
    width = 6.5 if not categorical else max(6.5, 0.28 * max(len({r.get(x_field) for r in result["rows"]}), 1))
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 4.2 * rows + (1.5 if categorical else 0)),
                             squeeze=False)
    titles = []
    for ax, key in zip(axes.flat, keys):
        mine = [r for r in result["rows"] if tuple(r.get(f) for f in result["panels"]) == key]
        if categorical:
            names = list(dict.fromkeys(str(r.get(x_field)) for r in mine))
            where = {n: i for i, n in enumerate(names)}
        for impl in result["impls"]:
            pts = [(r.get(x_field), r.get("results", {}).get(impl, {}).get(metric)) for r in mine]
            pts = [(x, y) for x, y in pts if _number(y)]
            if not pts:
                continue
            style = "-o" if impl.startswith("flashgen") else "--s"
            if categorical:
                pts = sorted((where[str(x)], y) for x, y in pts)
            else:
                pts = sorted(pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl, markersize=4)
        if categorical:
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=90, fontsize=7)
        else:
            xs = sorted({r[x_field] for r in mine})
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x // 1024}k" if isinstance(x, int) and x >= 1024 and x % 1024 == 0 else str(x)
                                for x in xs])
        ax.set_xlabel(x_field)
        ax.set_ylabel(metric)
        ax.set_title(_title(result, key))
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        titles.append(_title(result, key))
    for ax in list(axes.flat)[len(keys):]:
        ax.remove()
    gpu = result.get("meta", {}).get("gpu", "")
    fig.suptitle(f"flashgen bench {result['suite']}" + (f" on {gpu}" if gpu else ""))
    fig.tight_layout()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name or result['suite']}.png"
    fig.savefig(path, dpi=110)
    drawn = len(fig.axes)
    plt.close(fig)
    return {"path": str(path), "panels": titles, "axes": drawn}
