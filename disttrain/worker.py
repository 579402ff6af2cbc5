"""``python -m disttrain.worker CONFIG``: one worker rank of a run, started by the job process."""

import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from disttrain.fault.config import LOST_PEER_EXIT
from disttrain.fault.steps import NonFiniteStep, Preempted
from disttrain.run import run_worker

# what a rank sees when another rank died under it: the consequence, not the cause
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connectFullMesh failed")


def lost_a_peer(err: BaseException) -> bool:
    """Whether ``err`` is this rank's view of another rank's death (a failed collective or connection)."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(
        marker in str(err) for marker in PEER_LOST))


def run_and_exit(config_path: Path) -> None:
    """Run this rank of the run whose resolved config is ``config_path``, then leave the process with the rank's
    exit status (0, a diagnosed code, or 1 after printing the traceback)."""
    code = 0
    try:
        run_worker(config_path)
    except Preempted as stop:
        code = stop.code
    except NonFiniteStep as err:
        print(f"Error: {err}", file=sys.stderr)
        code = err.exit_code
    except Exception as err:  # noqa: BLE001 - every failure ends the rank; only its report differs
        code = 1
        if lost_a_peer(err):  # the supervisor names the rank that failed first; one line here is enough
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(f"disttrain: rank {os.environ.get('RANK', '?')} lost contact with another rank: {first}",
                  file=sys.stderr)
            code = LOST_PEER_EXIT
        else:
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank's work is complete and its process group destroyed; C++ threads left by torch.distributed
    # were seen to abort the interpreter's final teardown ("terminate called without an active exception"),
    # which would report a finished rank as failed. Leave without running that teardown.
    os._exit(code)


if __name__ == "__main__":
    run_and_exit(Path(sys.argv[1]))
