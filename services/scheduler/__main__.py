from services.scheduler.server import main

main()
