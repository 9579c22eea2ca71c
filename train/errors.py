"""User-facing errors: bad input ends with one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import functools
import sys


class UserError(Exception):
    """Bad input (recipe, path, model pair, prompt file). Printed as one line; exit status 2."""


def cli_main(func):
    """Wrap a command's main(): a UserError becomes `specdistill: error: ...` on stderr and exit 2."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UserError as err:
            print(f"specdistill: error: {err}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("specdistill: interrupted; rerun the same command to resume", file=sys.stderr)
            sys.exit(130)

    return wrapper
