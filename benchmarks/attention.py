"""Decode-attention benchmark (the same as `planekv bench attention`).

    python benchmarks/attention.py --shapes b32-t32k b1-t8k --json out.json

Prints a Markdown table and writes JSON; see planekv/bench/attention.py for what is measured.
"""

import sys

from planekv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
