import os
import sys

try:  # before torch is imported: in a deleted folder its MKL names the wrong cause
    os.getcwd()
except FileNotFoundError:
    print("error: the current folder was deleted: cd to a folder that exists, then run labkit "
          "again", file=sys.stderr)
    raise SystemExit(2) from None

from labkit.app.cli import main  # noqa: E402 - after the check above

raise SystemExit(main())
