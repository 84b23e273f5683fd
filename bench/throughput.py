"""Offline throughput benchmark: `python bench/throughput.py ...` = `pagedllm bench throughput ...`.

The implementation lives in pagedllm/benchmarks/throughput.py so the installed CLI can run it.
"""

import sys

from pagedllm.benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python bench/throughput.py"))
