"""Shared test helpers: fresh random inputs every run, random token trees.

Inputs are random on every run (a new seed each time, printed on failure); set
SPECDEC_TEST_SEED=<int> to replay a failing run. Statistical tests use their own fixed seeds.
"""

import contextlib
import importlib
import importlib.util
import os
import random
import sys

import pytest
import torch

import specdec_kernels

HAS_CUDA = torch.cuda.is_available()


@contextlib.contextmanager
def triton_interpret_env():
    """TRITON_INTERPRET=1 inside the block, the old value (or none) restored after it."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _import_triton_for_the_interpreter() -> None:
    """Without a GPU, Triton kernels run only in the interpreter, and triton picks interpreter or
    compiler when each @triton.jit function is defined, its own helpers (tl.sum, ...) at import.
    Import it first, with TRITON_INTERPRET=1 set just for the import, so that the
    test_*_triton.py modules can run the kernels in this process even though other test
    modules import triton at collection (transformers -> torch._dynamo). The variable is
    restored: `backend="triton"` on CPU tensors stays refused unless a test sets it.
    """
    if HAS_CUDA or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    with triton_interpret_env():
        try:
            import triton.language  # noqa: F401
        except Exception:  # a broken triton: its tests report it
            pass


def import_interpreted_kernels(module_name: str):
    """The Triton kernel module `module_name` built for the interpreter, or None where this
    process cannot have it (a CUDA machine, no triton, or triton imported without the variable
    before this conftest could). The module is imported with TRITON_INTERPRET=1 set."""
    if HAS_CUDA or importlib.util.find_spec("triton") is None:
        return None
    if module_name not in sys.modules:
        with triton_interpret_env():
            importlib.import_module(module_name)
    module = sys.modules.get(module_name)
    import triton.language as tl

    helpers_interpreted = not isinstance(tl.sum, sys.modules["triton"].runtime.JITFunction)
    return module if module is not None and module.interpreted() and helpers_interpreted else None


INTERPRETER_SKIP = (
    "CUDA present: this process compiles the Triton kernels for the GPU" if HAS_CUDA
    else "triton was imported without TRITON_INTERPRET=1 before conftest.py could"
) + "; test_interpreter_tests_in_a_fresh_process runs these"


_import_triton_for_the_interpreter()
HAS_C = specdec_kernels.LOAD_ERROR is None
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_c = pytest.mark.skipif(not HAS_C, reason=f"specdec_kernels._C unavailable: {specdec_kernels.LOAD_ERROR}")

TREE_KINDS = ("chain", "star", "bushy", "deep", "random")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


@pytest.fixture
def gen(request):
    """A torch.Generator with a fresh seed per test (or SPECDEC_TEST_SEED), printed on failure."""
    seed = int(os.environ.get("SPECDEC_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"SPECDEC_TEST_SEED={seed}  # replay with this environment variable")
    g = torch.Generator().manual_seed(seed)
    return g


def randint(gen, low, high, size=()):
    return torch.randint(low, high, size, generator=gen)


def random_parents(gen, batch: int, num_nodes: int, kind: str = "random", ragged: bool = True) -> torch.Tensor:
    """int64 [batch, num_nodes] valid parent arrays of the given shape family.

    chain: each node under the previous; star: every node under the root; bushy: parent
    drawn from the first few nodes; deep: parent among the last two nodes; random: any
    earlier node. With ragged=True each row keeps a random number of real nodes (>= 1) and
    pads the rest (parent -1).
    """
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        real = int(randint(gen, 1, num_nodes + 1)) if ragged else num_nodes
        for i in range(1, real):
            if kind == "chain":
                p = i - 1
            elif kind == "star":
                p = 0
            elif kind == "bushy":
                p = int(randint(gen, 0, min(i, 3)))
            elif kind == "deep":
                p = int(randint(gen, max(0, i - 2), i))
            elif kind == "random":
                p = int(randint(gen, 0, i))
            else:
                raise ValueError(kind)
            parents[b, i] = p
    return parents


def ancestors(parents_row, i: int) -> list:
    """Node i and its ancestors (i first), by walking parent links in plain Python."""
    out = [i]
    while parents_row[out[-1]] >= 0 and out[-1] != 0:
        out.append(int(parents_row[out[-1]]))
    return out


def distinct_sibling_tokens(gen, parents: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [B, T] tokens with distinct tokens among siblings (padding nodes get -1)."""
    batch, num_nodes = parents.shape
    tokens = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        tokens[b, 0] = int(randint(gen, 0, vocab))
        used = {}
        for i in range(1, num_nodes):
            p = int(parents[b, i])
            if p < 0:
                continue
            taken = used.setdefault(p, set())
            free = [t for t in range(vocab) if t not in taken]
            tok = free[int(randint(gen, 0, len(free)))]
            taken.add(tok)
            tokens[b, i] = tok
    return tokens
