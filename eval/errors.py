"""User-facing errors: bad input ends with one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import errno
import functools
import sys

# Environment failures that are the user's to fix (full disk, read-only or foreign output directory):
# one line, exit 2, like bad input. Every output is written under a temporary name and renamed, so
# what was complete before the failure stays complete.
WRITE_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


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
        except OSError as err:
            if err.errno not in WRITE_ERRORS:
                raise
            where = f" '{err.filename}'" if err.filename else ""
            print(f"specdistill: error: cannot write{where}: {err.strerror}; outputs completed before this "
                  "are intact; free space or fix permissions and rerun the same command to resume", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("specdistill: interrupted; rerun the same command to resume", file=sys.stderr)
            sys.exit(130)

    return wrapper
