"""The ``flashgen`` command line.

  flashgen emit --d 128 --causal --dtype bf16 [--arch sm_90a] [--block-m ...]
  flashgen compile --d 128 --arch sm_80      (offline, no GPU: prints the ptxas report)
  flashgen tune --gpu h200 --d 64,128        (Optuna search; --model without a GPU)
  flashgen show [--gpu h200] [--config PATH] (the tuned tables in use, or one file checked)
  flashgen bench fwd --out DIR               (GPU: table, JSON, plots; --plot-from FILE: plots only)
  flashgen explain --gpu h200 --d 128 --seqlen 4096 [--causal] [--measure]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from . import dispatch, families, gpus, mods, settings, tables
from .bench.cli import add_parser as add_bench
from .codegen import build, render
from .errors import FlashgenError, UnsupportedError
from .explain import add_parser as add_explain
from .problem import ProblemKey, bucket_of, head_dim_tile
from .tuner import space
from .tuner.run import add_arguments as add_tune_arguments
from .tuner.run import tune
from .version import __version__
from .spec import ARCHS, DTYPES
from .variants import Variant


def _spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d", type=int, required=True, help="head dim of the inputs (multiple of 8, <= 256)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right aligned) masking")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--arch", choices=ARCHS, help="compile target (default: the --gpu profile's, else sm_90a)")
    p.add_argument("--gpu", choices=sorted(gpus.PROFILES), help="GPU profile whose shared memory bounds the tile")
    p.add_argument("--kind", choices=sorted({*families.problems(), *families.FAMILIES}), default="fwd",
                   help="problem kind or kernel family (default fwd: the forward dispatch picks, any family; "
                        "fwd_v2 / fwd_sm90: the forward restricted to that family)")
    p.add_argument("--seqlen", type=int, default=4096, help="query length, for the tuned table's bucket")
    p.add_argument("--window", default=None, metavar="LEFT,RIGHT",
                   help="sliding window (flashgen.attention's window=; -1 unbounded): the windowed kernel")
    p.add_argument("--softcap", type=float, default=0.0, help="a softcap (> 0): the softcapped kernel")
    p.add_argument("--alibi", action="store_true", help="the ALiBi kernel")
    p.add_argument("--sinks", action="store_true", help="the kernel with learned sinks")
    p.add_argument("--varlen", action="store_true",
                   help="packed rows (attention_varlen): the kernel with its work-list entry (forward, backward)")
    p.add_argument("--fp8", action="store_true",
                   help="float8 e4m3 inputs: the forward's q, k, v (sm_90a), decode's KV cache (--kind decode_split)")
    p.add_argument("--page-size", type=int, default=None, metavar="KEYS",
                   help=f"with --varlen: K/V from a paged cache of pages of KEYS keys (attention_varlen's "
                        f"block_table; one of {', '.join(map(str, families.decode.PAGE_SIZES))}): the paged kernel")
    p.add_argument("--deterministic", action="store_true",
                   help="--kind bwd_dkdv or bwd_sm90: the dK/dV kernel deterministic=True runs (bwd_sm90's det "
                        "twin: dQ added in a fixed order)")
    for name in ("block-m", "block-n", "warps", "stages"):
        p.add_argument(f"--{name}", type=int, help=f"override the {name.replace('-', '_')} the rule picks")
    p.add_argument("--score-mod", metavar="FILE.py:NAME", default=None,
                   help="a score_mod(score, b, h, q_idx, kv_idx) function in FILE (which is imported, so it runs): "
                        "the forward kernel with it (fwd_sm90 on sm_90a, else fwd_v2), traced (flashgen.mods); "
                        "--causal: the causal key's tile")
    p.add_argument("--mask-mod", metavar="FILE.py:NAME", default=None,
                   help="a mask_mod(b, h, q_idx, kv_idx) function in FILE, likewise (with --score-mod or alone)")
    p.add_argument("--row-bounds", action="store_true",
                   help="with --mask-mod (forward): the kernel a call takes when every query row of its block mask "
                        "sees one run of keys (causal, windows, documents): partial blocks masked by each row's "
                        "first and last visible key instead of the mask_mod")


def spec_from_args(args):
    """The spec dispatch would pick for these arguments, with any overrides applied and validated."""
    if getattr(args, "row_bounds", False) and (not getattr(args, "mask_mod", None) or args.kind == "decode_split"):
        raise FlashgenError("--row-bounds is for a forward with --mask-mod (its partial blocks masked by the rows' "
                            "bounds)")
    if getattr(args, "score_mod", None) or getattr(args, "mask_mod", None):
        return _mod_spec_from_args(args)
    arch = args.arch or (gpus.get(args.gpu).arch if args.gpu else "sm_90a")
    budget = gpus.get(args.gpu).smem_per_block if args.gpu else gpus.ARCH_SMEM_PER_BLOCK[arch]
    if args.d % 8 or not 8 <= args.d <= 256:
        raise FlashgenError(f"--d {args.d}: head dims are multiples of 8 from 8 to 256")
    if args.kind in families.PROBLEMS:
        problem, family = args.kind, None
    else:  # a family's name: the problem it serves, restricted to it
        problem, family = families.family(args.kind).serves, args.kind
    if family is not None and family not in families.serving(problem, arch):
        raise FlashgenError(f"--kind {family} does not run on {arch}")
    window = None
    if args.window is not None:
        try:
            window = tuple(int(x) for x in str(args.window).split(","))
        except ValueError:
            raise FlashgenError(f"--window {args.window!r}: LEFT,RIGHT (ints, -1 unbounded)") from None
    decode = problem == "decode_split"  # causal whatever --causal says; a window's right side is 0 or -1
    if decode and window is not None and len(window) == 2 and window[1] > 0:
        raise FlashgenError(f"--window {args.window!r}: decode's window has a right side of 0 or -1 (it is causal)")
    fp8 = getattr(args, "fp8", False)
    if fp8 and problem not in ("fwd", "decode_split"):
        raise FlashgenError(f"--kind {args.kind}: --fp8 is the forward's (float8 e4m3 q, k, v) and decode's "
                            "(--kind decode_split: a float8 e4m3 KV cache)")
    try:
        variant = Variant.of(args.causal or decode, window, args.softcap, args.alibi, args.sinks, args.varlen, fp8)
    except ValueError as exc:
        raise FlashgenError(f"--window/--softcap: {exc}") from None
    page = getattr(args, "page_size", None)
    if page is not None and (not args.varlen or problem != "fwd"):
        raise FlashgenError("--page-size: a paged cache is the forward's, with --varlen (chunked prefill)")
    if page is not None and page not in families.decode.PAGE_SIZES:
        raise FlashgenError(f"--page-size {page}: one of {', '.join(map(str, families.decode.PAGE_SIZES))}")
    if args.varlen and problem not in ("fwd", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):
        raise FlashgenError(f"--kind {args.kind}: --varlen is the forward's and the dK/dV and dQ kernels'")
    if not variant.plain and problem not in ("fwd", "decode_split") and not problem.startswith("bwd_d"):
        raise FlashgenError(f"--kind {args.kind}: the variant options are the forward's, the backward's and "
                            "decode's")
    if problem.startswith("bwd"):
        variant = variant.backward()
    key = families.problem_key(problem, arch, args.dtype, args.d, variant.causal, args.seqlen)
    key = key.replace(variant=variant.key())
    try:
        spec = dispatch.select(key, args.gpu, budget, family=family)
    except (TypeError, ValueError) as exc:
        raise FlashgenError(f"{args.kind}: {exc}") from None
    if getattr(args, "deterministic", False) and problem != "bwd_dkdv_nodq" and problem != "bwd_dq":
        if problem != "bwd_dkdv":
            raise FlashgenError(f"--kind {args.kind}: --deterministic is the backward's (--kind bwd_dkdv, "
                                "bwd_sm90, bwd_dkdv_nodq, bwd_dq)")
        twin = dispatch.deterministic_twin(spec, budget)
        if twin is None:
            raise FlashgenError(f"--deterministic: here ({spec.kind}) deterministic=True computes dQ in "
                                "bwd_dkdv_nodq and bwd_dq: --kind bwd_dkdv_nodq and --kind bwd_dq")
        spec = twin
    # "is not None": an explicit 0 must reach validate() and be refused, not be dropped as falsy.
    overrides = {f: getattr(args, f) for f in ("block_m", "block_n", "warps", "stages")
                 if getattr(args, f) is not None}
    spec = spec.replace(**overrides)
    try:
        spec.validate()
        if page is not None:  # the kernel attention_varlen runs with this block table: boxes inside a page
            spec = families.paged_spec(spec, page)
    except (TypeError, ValueError, UnsupportedError) as exc:
        raise FlashgenError(str(exc)) from None
    if spec.smem_total() > budget:
        raise FlashgenError(f"{spec.name} needs {spec.smem_total()} B of shared memory, over {budget} B")
    return spec


def _mod_spec_from_args(args):
    """The forward kernel ``flashgen.attention`` runs with these mods (traced here; captured tensors may
    be on the CPU, nothing is launched), registered so that it renders and builds in this process."""
    others = [o for o, on in (("--window", args.window is not None), ("--softcap", args.softcap != 0.0),
                              ("--alibi", args.alibi), ("--sinks", args.sinks), ("--varlen", args.varlen),
                              ("--deterministic", getattr(args, "deterministic", False)),
                              ("--page-size", getattr(args, "page_size", None) is not None)) if on]
    if others:
        raise FlashgenError(f"--score-mod/--mask-mod take none of {', '.join(others)}: a mod expresses them")
    rows = getattr(args, "row_bounds", False)
    arch = args.arch or (gpus.get(args.gpu).arch if args.gpu else "sm_90a")
    decode = args.kind == "decode_split"
    kinds = ("fwd", "decode_split") + dispatch.MOD_FAMILIES
    if args.kind not in kinds or (args.kind == "fwd_sm90" and arch != "sm_90a"):
        raise FlashgenError("--score-mod/--mask-mod: mods run in the forward (--kind fwd, fwd_sm90 on sm_90a, or "
                            "fwd_v2) and in decode (--kind decode_split)")
    if args.d % 8 or not 8 <= args.d <= 256:
        raise FlashgenError(f"--d {args.d}: head dims are multiples of 8 from 8 to 256")
    try:
        pair, _ = mods.from_files(args.score_mod, args.mask_mod, allow_cpu=True)
    except mods.ModError as exc:
        raise FlashgenError(str(exc)) from None
    budget = gpus.get(args.gpu).smem_per_block if args.gpu else gpus.ARCH_SMEM_PER_BLOCK[arch]
    # verified as the call's own pick is (a tile whose kernel spills with these mods gives way): the kernel
    # the call would run, at the price of compiling it here
    try:
        if decode:  # (decode is causal; the split rule's middle regime, as the plain decode emit takes)
            key = families.problem_key("decode_split", arch, args.dtype, args.d, True, args.seqlen)
            spec = dispatch.mod_decode_spec(key, args.gpu, budget, mods.token_number(pair), "some", verify=True)
        else:
            key = ProblemKey("fwd", arch, args.dtype, head_dim_tile(args.d), args.causal, bucket_of(args.seqlen), "")
            spec = dispatch.mod_spec(key, args.gpu, budget, mods.token_number(pair), verify=True,
                                     family=None if args.kind == "fwd" else args.kind, row_bounds=rows)
    except UnsupportedError as exc:
        raise FlashgenError(str(exc)) from None
    overrides = {f: getattr(args, f) for f in ("block_m", "block_n", "warps", "stages") if getattr(args, f) is not None}
    try:
        return spec.replace(**overrides).validate()
    except (TypeError, ValueError) as exc:
        raise FlashgenError(str(exc)) from None


def cmd_emit(args) -> int:
    sys.stdout.write(render(spec_from_args(args)))
    return 0


def cmd_compile(args) -> int:
    spec = spec_from_args(args)
    binary = build(spec)
    r = binary.report
    info = {"spec": spec.name, "arch": spec.arch, "registers": r.registers, "spill_stores": r.spill_stores,
            "spill_loads": r.spill_loads, "stack_frame": r.stack_frame, "static_smem": r.static_smem,
            "dynamic_smem": spec.smem_bytes(), "cubin_bytes": len(binary.cubin), "problems": r.problems()}
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for k, v in info.items():
            print(f"{k:14s} {v}")
    return 1 if r.problems() else 0


def cmd_tune(args) -> int:
    return tune(args, args.argv)


def cmd_show(args) -> int:
    if args.config:
        _show([("file", tables.load(args.config, gpu=args.gpu))], None)
        return 0
    detected = None if args.gpu else gpus.detect()
    names = [gpus.get(args.gpu).name] if args.gpu else [detected.name] if detected else tables.shipped_gpus()
    if not (args.gpu or detected):
        print(f"# no known GPU here: the tables of every GPU a table is shipped for ({', '.join(names)}); "
              "--gpu NAME shows one")
    for gpu in names:
        sources = tables.tables(gpu)
        if not sources:
            print(f"no tuned tables for {gpu}: dispatch uses the default rule "
                  f"(looked in {tables.default_path(gpu)} and {tables.shipped_path(gpu)})")
            continue
        _show(sources, gpu)
    return 0


def _show(sources, gpu) -> None:
    """Print each table of ``sources`` ((origin, Table)); with ``gpu``, mark the entry dispatch uses for
    a key ('user' / 'shipped'), the one it passes over ('shadowed'), and one that only confirmed the
    default rule of its day where the rule has moved since ('rule': dispatch.superseded_by; a line under
    it names the rule's pick)."""
    for origin, table in sources:
        m = table.meta
        print(f"# {origin}: {table.path}\n#   gpu {m['gpu']} ({m.get('device_name', '')}), {m['arch']}, "
              f"{m['smem_per_block']} B smem/block, source {m['source']}, {m['date']}, "
              + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
        if "model_check" in m:
            c = m["model_check"]
            print(f"#   ranked by the cost model; checked on the {c['gpu']} ({c['keys']}, {c['measured']} keys, "
                  f"{c['date']}): its pick {c['geomean_regret']:.3f}x the measured best's time on average, "
                  f"{c['worst_regret']:.3f}x at worst, median rank correlation {c['median_spearman']:.2f}")
        print(f"{'key':42s} {'spec':44s} {'ms':>8s} {'TFLOP/s':>8s} {'gain':>6s} {'from':>8s}")
        for key in sorted(table.entries, key=lambda k: (k.kind, k.dtype, k.head_dim, k.causal, k.bucket)):
            e = table.entries[key]
            used = origin if gpu is None or tables.lookup_entry(gpu, key)[1] is e else "shadowed"
            rule = dispatch.superseded_by(key, e, m["smem_per_block"]) if used == origin and gpu else None
            gain = f"{e['speedup']:.2f}x" if e.get("speedup") else "-"
            tf = f"{e['tflops']:.0f}" if e.get("tflops") else "-"
            print(f"{space.key_name(key):42s} {e['spec'].name:44s} {e['time_ms']:8.3f} {tf:>8s} {gain:>6s} "
                  f"{'rule' if rule else used:>8s}")
            if rule:
                print(f"{'':42s}   the default rule of its day, since moved: {rule.name} serves")


class _Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: a missing or unknown argument prints
    ``<prog>: error: <what> (<prog> -h shows the usage)`` and exits 2, without the usage block.
    Subcommands' parsers are of this class too (``add_subparsers`` takes the parent's)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} -h shows the usage)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="flashgen", description="FlashAttention kernel generator and autotuner")
    parser.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("emit", help="print the exact CUDA source that would run")
    _spec_args(p)
    p.set_defaults(func=cmd_emit)
    p = sub.add_parser("compile", help="compile offline with NVRTC (no GPU) and print the resource report")
    _spec_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_compile)
    add_bench(sub)
    add_explain(sub)
    p = sub.add_parser("tune", help="search tile shapes on this GPU (or by the cost model) and write YAML")
    add_tune_arguments(p)
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("show", help="print the tuned tables in use, or check one YAML file")
    p.add_argument("--gpu", choices=sorted(gpus.PROFILES), help="GPU profile (default: the GPU here)")
    p.add_argument("--config", help="a YAML table to validate and print")
    p.set_defaults(func=cmd_show)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv[1:] if argv and argv[0] == "tune" else argv
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            return args.func(args)
        except FlashgenError as exc:
            return _error(exc, getattr(exc, "source_path", None))
        except (ValueError, TypeError, OSError) as exc:  # a value a check above missed: still one line
            return _error(exc)
        except Exception as exc:  # noqa: BLE001 -- a command-line error is one line, never a traceback
            settings.logger().debug("flashgen: %s", "internal error", exc_info=True)
            return _error(f"internal error ({type(exc).__name__}: {exc}); FLASHGEN_LOG=debug shows the traceback")


def _error(exc, source_path=None) -> int:
    """Print ``exc`` as one line (a compile error's log stays in its file) and return exit status 2."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    text = lines[0] + (f" (source: {source_path})" if source_path and len(lines) > 1 else "")
    print(f"flashgen: error: {text}", file=sys.stderr)
    return 2


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"flashgen: warning: {str(message).removeprefix('flashgen: ')}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
