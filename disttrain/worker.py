"""``python -m disttrain.worker CONFIG``: one worker rank of a run, started by the job process."""

import sys
from pathlib import Path

from disttrain.run import run_worker

if __name__ == "__main__":
    run_worker(Path(sys.argv[1]))
