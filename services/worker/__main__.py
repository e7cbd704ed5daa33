"""`python -m services.worker --role prefill|decode|unified ...`"""

from services.worker.server import main

main()
