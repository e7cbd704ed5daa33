"""`python -m services.gateway [flags]`."""

from services.gateway.server import main

if __name__ == "__main__":
    main()
