"""torchrun, minus its own traceback on a worker failure (the driver shows the rank's error),
and bound to the launcher's life: when the launcher dies, torchrun gets SIGTERM and stops its
workers (rlbatch.runtime.lifeline)."""

from __future__ import annotations

import signal
import sys

from rlbatch.runtime.lifeline import die_with_parent


def main() -> None:
    die_with_parent(signal.SIGTERM)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as err:
        failures = err.failures
        codes = [f.exitcode for f in failures.values()] or [1]
        code = next((c for c in codes if c and c > 0), 1)
        sys.exit(code)
    except KeyboardInterrupt:
        sys.exit(130)
    except SignalException as err:  # the launcher died (or SIGTERM): workers are stopped
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main()
