"""Verification (rejection sampling from logits) on the GPU; the code lives in
specdec_kernels/benchmarks/verify.py.

    python bench/bench_verify.py              # a short sweep (GPU)
    python bench/bench_verify.py --full       # the whole sweep (GPU)
    python bench/bench_verify.py --smoke      # CPU: tiny config under the Triton interpreter, not recorded
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first

from specdec_kernels.benchmarks.verify import main  # noqa: E402

raise SystemExit(main())
