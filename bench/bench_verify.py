"""Verification (rejection sampling from logits) on the GPU; the code lives in
specdec_kernels/benchmarks/verify.py.

    python bench/bench_verify.py              # a short sweep (GPU)
    python bench/bench_verify.py --full       # the whole sweep (GPU)
    python bench/bench_verify.py --smoke      # CPU: tiny config under the Triton interpreter, not recorded
"""

from specdec_kernels.benchmarks.verify import main

raise SystemExit(main())
