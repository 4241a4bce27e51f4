"""Benchmarks behind `specdec bench kernels` and `specdec bench e2e` (importable, so they run
from an installed package as well as from a checkout).

| module            | what it measures                                                          |
| ----------------- | ------------------------------------------------------------------------- |
| `common`          | shared pieces: run metadata for the JSON records, timers, tables, paths    |
| `ngram`           | n-gram drafting on the CPU against numba / torch unfold / HF / reference |
| `tree_attention`  | tree attention on the GPU against SDPA with a dense mask, Flex, FlashInfer |
| `verify`          | batched verification on the GPU against torch-native, FlashInfer, reference |
| `paged`           | paged tree attention against the dense op on the same logical cache (CPU/GPU) |
| `kernels`         | runs each per-op benchmark's `main(argv)` (the `specdec bench kernels` command) |
| `e2e`             | end-to-end decoding on the four workloads against HF `generate` (a package: `models`, `runner`, `report`) |

Each per-op module exposes `main(argv=None) -> int`; `bench/bench_<op>.py` in a checkout is a
thin wrapper around it that runs the installed package (README's editable install: the checkout). Results go to `bench/results/` (see `common.results_dir`).
"""
