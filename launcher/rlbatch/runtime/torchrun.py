"""torchrun, minus its own traceback on a worker failure (the driver shows the rank's error)."""

from __future__ import annotations

import sys


def main() -> None:
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


if __name__ == "__main__":
    main()
