"""``python -m disttrain.worker CONFIG``: one worker rank of a run, started by the job process."""

import os
import sys
from pathlib import Path

from disttrain.run import run_worker

if __name__ == "__main__":
    run_worker(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank's work is complete and its process group destroyed; C++ threads left by torch.distributed
    # were seen to abort the interpreter's final teardown ("terminate called without an active exception"),
    # which would report a finished rank as failed. Leave without running that teardown.
    os._exit(0)
