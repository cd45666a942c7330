"""Render a KernelSpec into CUDA C++ source (Jinja2, StrictUndefined)."""
from __future__ import annotations

import functools
from importlib import resources

import jinja2


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("flashgen", "templates"),
        undefined=jinja2.StrictUndefined,  # a missing variable is an error, never empty text
        keep_trailing_newline=True,
        autoescape=False,
    )
    # Device headers are plain C++ (inline PTX is full of "{%0"), so they are
    # pasted in verbatim by `header("x.cuh")` rather than parsed as Jinja.
    env.globals["header"] = _header
    return env


@functools.lru_cache(maxsize=None)
def _header(name: str) -> str:
    if not name.endswith(".cuh") or "/" in name or "\\" in name:
        raise ValueError(f"not a template header: {name!r}")
    text = (resources.files("flashgen") / "templates" / name).read_text()
    return f"// ---- {name} ----\n{text}"


@functools.lru_cache(maxsize=512)
def render(spec) -> str:
    """The exact CUDA source of ``spec`` (validated first; ``ValueError`` if invalid)."""
    from .. import __version__

    ctx = spec.context()
    ctx["version"] = __version__
    return _environment().get_template(spec.family.template).render(**ctx)
