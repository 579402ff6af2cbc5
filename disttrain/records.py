"""The records a run keeps beside its checkpoints (the job's ``logs/restarts.json`` and ``logs/membership.jsonl``, the
ranks' ``logs/stragglers.jsonl``): written where the disk allows. A record that cannot be written (a full disk, a
lost mount) costs a one-line warning, never the job or the run that keeps it."""

from __future__ import annotations

import sys
from pathlib import Path


def keep_record(path: Path, text: str, append: bool = False) -> bool:
    """Write (or append) ``text`` to ``path``; on an OS error print one line naming the file and go on. Whether it
    was written."""
    try:
        with open(path, "a" if append else "w") as out:
            out.write(text)
    except OSError as err:
        print(f"disttrain: could not write {path} ({err.strerror or err}); the job goes on without it",
              file=sys.stderr, flush=True)
        return False
    return True
