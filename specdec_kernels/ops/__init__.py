"""The ops: one module per op (argument checks, dispatch to a backend), with the backends
beside them: `reference/` (plain torch, the ground truth), `triton/`, and the compiled C++/CUDA
kernels of `specdec_kernels._C` (loaded by `_extension`, which also registers the fake
implementations of `_fake` for tracing). Shared pieces: `_checks` (input validation),
`philox` (counter-based random numbers), `sampling` (target distributions), `trie` (merging
token sequences into trees), `paged` (block-table helpers), `small_linear` (the drafters'
small matrix products). Nothing here imports the loop, the heads or the integrations.
"""
