"""Entry point of the decode worker: the generic worker with the role preset to decode."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.worker import server as worker_server


def main(argv: Sequence[str] | None = None) -> None:
    """Run a decode worker (listen and metrics ports default to the decode role's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    worker_server.main(["--role", "decode", *args], prog="pdserve decode-worker")


if __name__ == "__main__":
    main()
