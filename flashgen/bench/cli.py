"""``flashgen bench SUITE [options] --out DIR`` and ``flashgen bench --plot-from FILE --out DIR``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import FlashgenError
from . import report, suites


def _common(p, suppress: bool) -> None:
    default = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--out", default=default("bench-results"),
                   help="folder for the JSON and the plot (default ./bench-results)")
    p.add_argument("--name", default=default(None), help="file name stem (default: the suite's name)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite (table, JSON, PNG plots), or plot a stored result",
                       description="Run a named benchmark suite on the GPU (`flashgen bench fwd --out DIR`): print "
                                   "a table, write DIR/<suite>.json and DIR/<suite>.png. Or plot a stored result "
                                   "without a GPU: `flashgen bench --plot-from FILE --out DIR`.")
    p.add_argument("--plot-from", metavar="FILE", help="plot this stored result instead of running a suite")
    _common(p, suppress=False)
    runs = p.add_subparsers(dest="suite", metavar="SUITE")
    for suite in suites().values():
        sp = runs.add_parser(suite.name, help=suite.help, description=suite.help)
        _common(sp, suppress=True)  # the suite's --out/--name, without overriding ones given before it
        sp.add_argument("--no-plot", action="store_true", help="write the JSON and the table only")
        suite.add_args(sp)
    p.set_defaults(func=cmd_bench, no_plot=False)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cmd_bench(args) -> int:
    if args.plot_from:
        if args.suite:
            raise FlashgenError("give either a suite to run or --plot-from FILE, not both")
        try:
            result = report.load(args.plot_from)
        except ValueError as exc:
            raise FlashgenError(str(exc)) from None
        return _plot(result, args, required=True)
    if not args.suite:
        raise FlashgenError(f"name a suite to run ({', '.join(sorted(suites()))}) or give --plot-from FILE")
    suite = suites()[args.suite]
    partial = Path(args.out) / f"{args.name or suite.name}.partial.json"
    args.checkpoint = lambda result: report.save(result, partial)
    try:
        result = suite.run(args, _progress)
    except ValueError as exc:  # bad option values, raised before anything runs
        raise FlashgenError(str(exc)) from None
    path = report.save(result, Path(args.out) / f"{args.name or suite.name}.json")
    partial.unlink(missing_ok=True)
    print(report.table(result))
    print(f"wrote {path}")
    code = 0 if args.no_plot else _plot(result, args, required=False)
    # A suite may ask for a non-zero exit after writing everything (sass --compare --strict: a kernel
    # changed), so that a script can stop on it.
    return int(result.get("exit_status", 0)) or code


def _plot(result, args, required: bool) -> int:
    why = report.plottable(result)
    if why and not required:  # a suite without numeric rows (sass): the table and JSON are the result
        print(f"no plot: {why}", file=sys.stderr)
        return 0
    try:
        info = report.plot(result, args.out, args.name)
    except ImportError as exc:
        if required:
            raise FlashgenError(str(exc)) from None
        print(f"no plot: {exc}", file=sys.stderr)
        return 0
    except ValueError as exc:
        raise FlashgenError(str(exc)) from None
    print(f"wrote {info['path']} ({info['axes']} panels: {'; '.join(info['panels'])})")
    return 0
