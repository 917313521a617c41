"""``python -m planekv.services.store``: run the store service in the foreground."""

import sys

from .app import main

if __name__ == "__main__":
    sys.exit(main())
