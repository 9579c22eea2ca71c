"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to a temporary sibling, fsync it, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, data) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
