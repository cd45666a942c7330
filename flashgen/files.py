"""Files the way the binary cache and the tuned tables need them: atomic writes that honour the
umask, locks that leave nothing behind, and reads that refuse what is not a small regular file.

- ``atomic_write(path, data)``: a temporary file in the same folder, then ``os.replace``: a reader
  sees the old file or the new one, never half of one. The file gets the mode an ordinary
  ``open()`` would (0666 less the umask), so a cache shared between users stays readable.
- ``locked(folder)``: an exclusive ``flock`` on the folder itself (made if missing), released on
  exit. No lock file is created, so none is left behind.
- ``read_regular(path, limit)``: the bytes of a regular file of at most ``limit`` bytes;
  ``OSError`` subclasses for anything else (a directory, a FIFO, a device, a dangling link, a
  file too large), so that no read blocks or fills the memory.
- ``user_function(text)``: the function NAME of a ``FILE.py:NAME`` the command line names (a user mod:
  ``flashgen emit/compile/tune --score-mod``); FILE is imported, so its code runs, as the user's own
  program's would. ``ValueError`` says what is wrong, in one line.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, data: bytes) -> Path:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def locked(folder):
    """Hold an exclusive lock on ``folder`` (created with its parents if missing)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield folder
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class NotARegularFile(OSError):
    """The path exists but is a directory, a FIFO, a device or a dangling link."""


class TooLarge(OSError):
    """The file is larger than the reader accepts."""


def read_regular(path, limit: int) -> bytes:
    path = Path(path)
    try:
        info = os.stat(path)  # follows links: a dangling one raises FileNotFoundError
    except FileNotFoundError:
        if os.path.islink(path):
            raise NotARegularFile(f"{path} is a link to nothing") from None
        raise
    if not stat.S_ISREG(info.st_mode):
        raise NotARegularFile(f"{path} is not a regular file")
    if info.st_size > limit:
        raise TooLarge(f"{path} has {info.st_size} bytes, more than the {limit} accepted")
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path} has more than the {limit} bytes accepted")
    return data


def user_function(text: str):
    """The function NAME of ``FILE.py:NAME`` (FILE imported); ``ValueError`` naming what is wrong."""
    path, sep, name = str(text).rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"{text!r}: FILE.py:NAME")
    if not os.path.isfile(path):
        raise ValueError(f"no file {path!r}")
    where = importlib.util.spec_from_file_location(f"flashgen_user_mods_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(where)
    try:
        where.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 -- the user's file: its error in one line
        raise ValueError(f"importing {path} raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path} has no function {name!r}")
    return fn
