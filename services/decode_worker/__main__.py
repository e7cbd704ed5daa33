"""`python -m services.decode_worker ...`"""

from services.decode_worker.server import main

main()
