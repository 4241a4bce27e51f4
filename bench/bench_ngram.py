"""N-gram (prompt lookup) drafting on the CPU; the code lives in specdec_kernels/benchmarks/ngram.py.

    python bench/bench_ngram.py            # short sweep (~1-2 min on 2 cores)
    python bench/bench_ngram.py --full     # every B x L, slow peers on bigger inputs

Runs the installed specdec_kernels: in a checkout, the editable install of README's quick
start (pip install -e .) is this checkout.
"""

from specdec_kernels.benchmarks.ngram import main

raise SystemExit(main())
