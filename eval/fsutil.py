"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary sibling of `path` to write; then fsync it and rename it onto `path` (removed on failure)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` so that a reader sees the old file or the new one, never half of one."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
