"""``python -m disttrain.worker CONFIG``: one worker rank of a run, started by the job process."""

import os
import sys
from pathlib import Path

from disttrain.fault.steps import NonFiniteStep, Preempted
from disttrain.run import run_worker

if __name__ == "__main__":
    code = 0
    try:
        run_worker(Path(sys.argv[1]))
    except Preempted as stop:
        code = stop.code
    except NonFiniteStep as err:
        print(f"Error: {err}", file=sys.stderr)
        code = err.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank's work is complete and its process group destroyed; C++ threads left by torch.distributed
    # were seen to abort the interpreter's final teardown ("terminate called without an active exception"),
    # which would report a finished rank as failed. Leave without running that teardown.
    os._exit(code)
