"""Tree attention on the GPU; the code lives in specdec_kernels/benchmarks/tree_attention.py.

    python bench/bench_tree_attention.py              # a few configs (GPU)
    python bench/bench_tree_attention.py --full       # the full sweep (GPU)
    python bench/bench_tree_attention.py --smoke      # CPU: tiny config under the Triton interpreter, not recorded
"""

from specdec_kernels.benchmarks.tree_attention import main

raise SystemExit(main())
