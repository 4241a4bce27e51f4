"""End-to-end decoding benchmark; the code lives in specdec_kernels/benchmarks/e2e.py.

    python bench/bench_e2e.py              # same as `specdec bench e2e` (short run)
    python bench/bench_e2e.py --full       # more prompts, longer outputs
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first

from specdec_kernels.benchmarks.e2e import main  # noqa: E402

raise SystemExit(main())
