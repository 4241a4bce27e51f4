"""Tree attention on the GPU; the code lives in specdec_kernels/benchmarks/tree_attention.py.

    python bench/bench_tree_attention.py              # a few configs (GPU)
    python bench/bench_tree_attention.py --full       # the full sweep (GPU)
    python bench/bench_tree_attention.py --smoke      # CPU: tiny config under the Triton interpreter, not recorded
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package first

from specdec_kernels.benchmarks.tree_attention import main  # noqa: E402

raise SystemExit(main())
