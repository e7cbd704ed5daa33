"""Entry point of the prefill worker: the generic worker with the role preset to prefill."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.worker import server as worker_server


def main(argv: Sequence[str] | None = None) -> None:
    """Run a prefill worker (listen and metrics ports default to the prefill role's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    worker_server.main(["--role", "prefill", *args], prog="pdserve prefill-worker")


if __name__ == "__main__":
    main()
