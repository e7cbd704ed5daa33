"""`python -m services.prefill_worker ...`"""

from services.prefill_worker.server import main

main()
