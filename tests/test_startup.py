"""What a new process pays before its first result, without a GPU: the parsed-table cache, the NVRTC
version stamp, and the imports that wait until they are needed (``flashgen bench startup`` times the
whole first call on a GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashgen import settings, tables
from flashgen.codegen import compiler
from flashgen.errors import ConfigError

SHIPPED = tables.shipped_path("h200")


def _parsed_files():
    folder = settings.home() / "cache" / "tables"
    return sorted(folder.glob("*.json")) if folder.exists() else []


def test_a_table_is_parsed_once_then_read_from_the_cache(monkeypatch):
    first = tables.load(SHIPPED, gpu="h200")
    assert len(_parsed_files()) == 1
    # A second read never reaches the YAML parser.
    monkeypatch.setattr(tables, "_safe_document", lambda text: pytest.fail("parsed again"))
    second = tables.load(SHIPPED, gpu="h200")
    assert second.entries == first.entries and second.meta == first.meta


def test_the_cache_hits_only_the_same_bytes_and_keeps_one_entry_per_table(tmp_path, monkeypatch):
    path = tmp_path / "h200.yaml"
    path.write_bytes(SHIPPED.read_bytes())
    tables.load(path, gpu="h200")
    path.write_text(path.read_text().replace("entries:", "# edited\nentries:", 1))
    parsed = []
    real = tables._safe_document
    monkeypatch.setattr(tables, "_safe_document", lambda text: (parsed.append(1), real(text))[1])
    tables.load(path, gpu="h200")
    assert parsed == [1]  # the edited file is a miss: parsed again
    assert len(_parsed_files()) == 1  # and its entry replaced, not one more file per version
    tables.load(path, gpu="h200")
    assert parsed == [1]


@pytest.mark.parametrize("content", ['[]', '{"sha256": "0", "document": {}}', '{', 'null'])
def test_a_malformed_cached_document_is_a_miss(content):
    tables.load(SHIPPED, gpu="h200")
    (cached,) = _parsed_files()
    cached.write_text(content)
    table = tables.load(SHIPPED, gpu="h200")  # parsed again from the YAML
    assert table.entries


def test_a_cached_document_is_validated_like_a_parsed_one():
    """An edited cached document (same name, same recorded hash) is still checked field by field."""
    tables.load(SHIPPED, gpu="h200")
    (cached,) = _parsed_files()
    record = json.loads(cached.read_text())
    first = next(iter(record["document"]["entries"]))
    first["spec"]["block_m"] = 7
    cached.write_text(json.dumps(record))
    with pytest.raises(ConfigError):
        tables.load(SHIPPED, gpu="h200")


def test_an_unusable_cache_folder_only_costs_the_parse(flashgen_home):
    flashgen_home.mkdir(parents=True, exist_ok=True)
    (flashgen_home / "cache").write_text("a file where the cache folder would be")
    assert tables.load(SHIPPED, gpu="h200").entries


def test_a_document_json_cannot_give_back_is_not_kept(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("meta: {date: 2026-12-01}\nentries: []\n")  # a YAML date: not JSON
    with pytest.raises(ConfigError):
        tables.load(path)
    assert _parsed_files() == []


def test_aliases_are_refused_also_when_nested_in_mappings(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("meta: &m {format: 3}\nentries: [{meta: *m}]\n")
    with pytest.raises(ConfigError, match="aliases"):
        tables.load(path)


def test_the_nvrtc_version_is_stamped_then_read_without_loading_nvrtc(monkeypatch):
    from cupy_backends.cuda.libs import nvrtc

    monkeypatch.setattr(compiler, "_version", None)
    version = compiler.nvrtc_version()
    stamp = settings.home() / "kernels" / "nvrtc.json"
    record = json.loads(stamp.read_text())
    assert tuple(record["version"]) == version and os.path.exists(record["library"])
    monkeypatch.setattr(compiler, "_version", None)
    monkeypatch.setattr(nvrtc, "getVersion", lambda: pytest.fail("NVRTC asked again"))
    assert compiler.nvrtc_version() == version


@pytest.mark.parametrize("edit", [
    lambda r: r.update(stat=[0, 0, 0]),                      # the library changed
    lambda r: r["environment"].update(LD_LIBRARY_PATH="/x"),  # another environment
    lambda r: r.update(version="13.0"),                       # malformed
    lambda r: r.update(library=7),
])
def test_a_stale_or_malformed_stamp_asks_nvrtc(monkeypatch, edit):
    from cupy_backends.cuda.libs import nvrtc

    monkeypatch.setattr(compiler, "_version", None)
    version = compiler.nvrtc_version()
    stamp = settings.home() / "kernels" / "nvrtc.json"
    record = json.loads(stamp.read_text())
    edit(record)
    stamp.write_text(json.dumps(record))
    asked = []
    real = nvrtc.getVersion
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (asked.append(1), real())[1])
    monkeypatch.setattr(compiler, "_version", None)
    assert compiler.nvrtc_version() == version and asked == [1]


def test_a_warm_first_lookup_imports_no_yaml_parser_and_no_cupy(flashgen_home):
    """With the kernel and the parsed table cached, dispatch's pick and the kernel's build (the source
    is rendered for its cache key, the binary read from the disk cache) need no YAML parser; nothing
    imports CuPy."""
    code = ("import sys\n"
            "from flashgen import dispatch\n"
            "from flashgen.codegen import build\n"
            "from flashgen.problem import ProblemKey\n"
            "spec = dispatch.select(ProblemKey('fwd', 'sm_90a', 'bf16', 128, False, 1024), 'h200', 232448)\n"
            "build(spec)\n"
            "print(sorted(m for m in ('jinja2', 'yaml', 'cupy') if m in sys.modules))\n")
    env = settings.child_environment(FLASHGEN_HOME=str(flashgen_home))
    env.pop("FLASHGEN_NO_COMPILE", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    # the cold run parses the table, renders, and compiles (NVRTC's module brings CuPy in)
    assert {"jinja2", "yaml"} <= set(json.loads(first.stdout.strip().replace("'", '"')))
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().replace("'", '"')) == ["jinja2"]
