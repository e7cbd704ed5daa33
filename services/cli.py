"""The `pdserve` command: run one service, start the whole stack (`up`), or stream a completion.

pdserve gateway|scheduler|load-monitor|prefill-worker|decode-worker|worker [service flags]
pdserve up [--unified] [--model default] [--device cpu] ...
pdserve generate "Why is the sky blue?" [--address 127.0.0.1:50051] [--max-tokens 64]
pdserve run-batch -i requests.jsonl -o results.jsonl [--url http://127.0.0.1:50091]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SERVICES = {
    "gateway": "services.gateway.server",
    "scheduler": "services.scheduler.server",
    "load-monitor": "services.load_monitor.server",
    "prefill-worker": "services.prefill_worker.server",
    "decode-worker": "services.decode_worker.server",
    "worker": "services.worker.server",
}

USAGE = """usage: pdserve COMMAND [flags]

commands:
  up               start load-monitor, scheduler, workers and gateway on this machine
  generate TEXT    stream a completion from a running gateway
  run-batch        run an OpenAI batch file (JSONL) through a running gateway's Batch API
  gateway | scheduler | load-monitor | prefill-worker | decode-worker | worker
                   run one service (pdserve SERVICE --help lists its flags and env vars)
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    if command in SERVICES:
        module = importlib.import_module(SERVICES[command])
        module.main(rest)
        return
    if command == "up":
        from services.up import main as up_main

        up_main(rest)
        return
    if command == "generate":
        from services.generate_cli import main as generate_main

        generate_main(rest)
        return
    if command == "run-batch":
        from services.batch_cli import main as batch_main

        batch_main(rest)
        return
    print(f"pdserve: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
