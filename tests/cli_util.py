"""Running ``flashgen.cli.main`` in a test: (exit code, stdout, stderr)."""
from __future__ import annotations

from flashgen.cli import main


def run_main(capsys, *argv):
    """(exit code, stdout, stderr) of flashgen.cli.main, counting argparse's SystemExit as an exit."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err
