"""``python -m planekv.services.control``: run the control plane in the foreground."""

import sys

from .app import main

if __name__ == "__main__":
    sys.exit(main())
