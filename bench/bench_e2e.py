"""End-to-end decoding benchmark; the code lives in specdec_kernels/benchmarks/e2e/.

    python bench/bench_e2e.py              # same as `specdec bench e2e` (short run)
    python bench/bench_e2e.py --full       # more prompts, longer outputs
"""

from specdec_kernels.benchmarks.e2e import main

raise SystemExit(main())
