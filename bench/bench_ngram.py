"""N-gram (prompt lookup) drafting on the CPU; the code lives in specdec_kernels/benchmarks/ngram.py.

    python bench/bench_ngram.py            # short sweep (~1-2 min on 2 cores)
    python bench/bench_ngram.py --full     # every B x L, slow peers on bigger inputs
"""

from specdec_kernels.benchmarks.ngram import main

raise SystemExit(main())
