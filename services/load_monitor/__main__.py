from services.load_monitor.server import main

main()
