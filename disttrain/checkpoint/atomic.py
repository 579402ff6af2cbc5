"""A file an export writes whole or not at all: written beside its place as ``<name>.partial``, then renamed over
it, so a crash leaves no half-written file under the name a reader opens (the checkpoint folders are written the
same way, ``disttrain.checkpoint.sharded``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomically(output: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write`` on a staging path beside ``output``, give the file the mode the umask gives new files, and
    rename it to ``output`` (replacing a file there); returns ``output``."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".partial")
    try:
        write(staging)
        staging.chmod(new_file_mode())  # safetensors writes its files owner-only; torch.save as the umask says
        staging.replace(output)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return output


def new_file_mode() -> int:
    """The mode the umask gives a new file (reading the umask means setting it: put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask
