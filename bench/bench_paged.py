"""Paged against dense tree attention; the code lives in specdec_kernels/benchmarks/paged.py.

    python bench/bench_paged.py                 # CPU (or GPU): SmolLM2-135M shapes, page size 16
    python bench/bench_paged.py --smoke         # one tiny config, nothing recorded
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first

from specdec_kernels.benchmarks.paged import main  # noqa: E402

raise SystemExit(main())
