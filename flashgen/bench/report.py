"""Print, save and plot a bench result (any suite: see the format in ``flashgen.bench``).

No torch and no GPU needed: plots can be made on any machine from a stored
JSON (``flashgen bench --plot-from results.json --out DIR``). matplotlib is
the ``bench`` extra and is imported only by ``plot``.
"""
from __future__ import annotations

import json
import os
import tempfile
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
        json.dump(result, fh, indent=1)
    os.replace(tmp, path)
    return path


def panels(result: dict) -> list[tuple]:
    """The distinct panel keys (values of ``result["panels"]`` fields), in first-seen order."""
    seen = []
    for row in result["rows"]:
        key = tuple(row[f] for f in result["panels"])
        if key not in seen:
            seen.append(key)
    return seen


def _title(result, key) -> str:
    return ", ".join(f"{f}={v}" for f, v in zip(result["panels"], key))


def table(result: dict) -> str:
    """The result as a text table: one line per row, one column per implementation (metric, or '-'/'skip'/'err')."""
    impls = result["impls"]
    width = max(8, *(len(i) for i in impls)) if impls else 8
    head = [f"{f:>9}" for f in result["panels"]] + [f"{result['x']:>7}"] + [f"{i:>{width}}" for i in impls]
    lines = [" ".join(head), f"  ({result['metric']}; {result.get('convention', '')})"]
    for row in result["rows"]:
        cells = [f"{str(row[f]):>9}" for f in result["panels"]] + [f"{row[result['x']]:>7}"]
        for impl in impls:
            c = row["results"].get(impl, {})
            value = c.get(result["metric"])
            text = f"{value:.1f}" if value is not None else "skip" if "skipped" in c else "err" if "error" in c else "-"
            cells.append(f"{text:>{width}}")
        lines.append(" ".join(cells))
    errors = sorted({f"{impl}: {c['error']}" for row in result["rows"] for impl, c in row["results"].items()
                     if "error" in c})
    if errors:
        lines.append("errors:")
        lines += [f"  {e}" for e in errors[:20]]
    return "\n".join(lines)


def plot(result: dict, out_dir, name: str | None = None) -> dict:
    """One PNG, one panel per panel key, metric against x, one line per implementation (log2 x axis).

    Returns {"path": the PNG, "panels": the panel titles, "axes": the number of panels drawn}.
    Raises ImportError with the install hint when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'flashgen[bench]' (or plot later from the JSON "
                          "with `flashgen bench --plot-from FILE --out DIR`)") from None
    keys = panels(result)
    if not keys:
        raise ValueError("the result has no rows to plot")
    cols = min(len(keys), 2)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    titles = []
    for ax, key in zip(axes.flat, keys):
        mine = [r for r in result["rows"] if tuple(r[f] for f in result["panels"]) == key]
        xs = sorted({r[result["x"]] for r in mine})
        for impl in result["impls"]:
            pts = [(r[result["x"]], r["results"].get(impl, {}).get(result["metric"])) for r in mine]
            pts = sorted((x, y) for x, y in pts if y is not None)
            if pts:
                style = "-o" if impl.startswith("flashgen") else "--s"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=impl, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
        ax.set_xlabel(result["x"])
        ax.set_ylabel(result["metric"])
        ax.set_title(_title(result, key))
        ax.grid(True, alpha=0.3)
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
