"""matplotlib is an optional extra (`pip install -e '.[bench]'`): benchmarks write their JSON and
markdown results first and draw plots last, skipping them with a one-line notice when matplotlib is
missing, so a missing plotting library never costs a result."""
from __future__ import annotations

import sys


def pyplot(path: str):
    """matplotlib.pyplot on the Agg backend, or None (after a notice naming `path`) when matplotlib is
    not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install matplotlib; the "
              f"tables are written)", file=sys.stderr, flush=True)
        return None
    return plt
