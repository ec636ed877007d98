"""``python -m kvb_server``: same as ``kvboost-server``."""

from kvb_server.cli import main

if __name__ == "__main__":
    main()
