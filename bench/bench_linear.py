"""The target's verify forward with few-row linears by our kernel and by F.linear (CPU); the code lives in
specdec_kernels/benchmarks/linear.py.

    python bench/bench_linear.py           # same as `specdec bench linear` (~1-2 min on 2 cores)
"""

from specdec_kernels.benchmarks.linear import main

raise SystemExit(main())
