"""Shared test helpers: fresh random inputs every run, random token trees.

Inputs are random on every run (a new seed each time, printed on failure); set
SPECDEC_TEST_SEED=<int> to replay a failing run. Statistical tests use their own fixed seeds.
"""

import contextlib
import importlib
import importlib.util
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

import specdec_kernels

HAS_CUDA = torch.cuda.is_available()


class WordTokenizer:
    """A stand-in chat tokenizer for tiny random models: words and punctuation hashed into a
    vocabulary of `vocab` ids (stable across runs), each id decoded as a word of its own, a
    trivial chat template."""

    chat_template = "user: {content}\nassistant:"
    pad_token_id = 0

    def __init__(self, vocab: int):
        self.vocab = vocab

    def _ids(self, text):
        return [1 + sum(map(ord, w)) * 31 % (self.vocab - 1) for w in re.findall(r"\w+|[^\w\s]", text)]

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = self._ids(text)
        return {"input_ids": torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        if add_generation_prompt:
            return self.chat_template.format(content=messages[-1]["content"])
        return "user: " + messages[-1]["content"] + "\n"

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{int(t)}" for t in ids)


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


def _interpreter_defect():
    """Why this process's Triton interpreter cannot run our kernels, or None (also where it
    is not used: a GPU, no triton). Triton 3.6's interpreter (the GPU machine's version) calls
    int() on a value loaded from memory as a 1-element array when it bounds a Python `range`,
    which current numpy refuses ("only 0-dimensional arrays can be converted to Python
    scalars"): every kernel that loops up to a row's length fails there. Compiled kernels are
    not affected; Triton 3.9 interprets them."""
    if HAS_CUDA or "triton" not in sys.modules:
        return None
    import numpy
    import triton
    import triton.language as tl

    with triton_interpret_env():
        @triton.jit
        def count_to_loaded_bound(n_ptr, out_ptr):
            count = tl.zeros([1], dtype=tl.int32)
            for _ in range(0, tl.load(n_ptr)):
                count += 1
            tl.store(out_ptr + tl.arange(0, 1), count)

        out = torch.zeros(1, dtype=torch.int32)
        try:
            count_to_loaded_bound[(1,)](torch.tensor([3], dtype=torch.int32), out)
        except Exception as error:  # the interpreter's own error, whatever its type
            return (f"triton {triton.__version__}'s interpreter cannot bound a loop by a loaded value "
                    f"(numpy {numpy.__version__}): {error}")
    return None if int(out[0]) == 3 else f"triton {triton.__version__}'s interpreter counted a loop wrong"


def import_interpreted_kernels(module_name: str):
    """The Triton kernel module `module_name` built for the interpreter, or None where this
    process cannot have it (a CUDA machine, no triton, triton imported without the variable
    before this conftest could, or an interpreter that cannot run our kernels:
    INTERPRETER_DEFECT). The module is imported with TRITON_INTERPRET=1 set."""
    if HAS_CUDA or importlib.util.find_spec("triton") is None or INTERPRETER_DEFECT is not None:
        return None
    if module_name not in sys.modules:
        with triton_interpret_env():
            importlib.import_module(module_name)
    module = sys.modules.get(module_name)
    import triton.language as tl

    helpers_interpreted = not isinstance(tl.sum, sys.modules["triton"].runtime.JITFunction)
    return module if module is not None and module.interpreted() and helpers_interpreted else None


_import_triton_for_the_interpreter()
INTERPRETER_DEFECT = _interpreter_defect()
INTERPRETER_SKIP = (
    "CUDA present: this process compiles the Triton kernels for the GPU" if HAS_CUDA
    else INTERPRETER_DEFECT if INTERPRETER_DEFECT is not None
    else "triton was imported without TRITON_INTERPRET=1 before conftest.py could"
) + "; test_interpreter_tests_in_a_fresh_process runs these"


def interpreter_fixture(interpreted):
    """A module-scoped `interpreter` fixture for a test module (assign it to the name
    `interpreter`): the interpreted kernel module `interpreted` (from import_interpreted_kernels),
    with TRITON_INTERPRET=1 set while the module's tests run (dispatch() refuses CPU tensors for
    backend="triton" without it); skips with INTERPRETER_SKIP where `interpreted` is None."""

    @pytest.fixture(scope="module")
    def interpreter():
        if interpreted is None:
            pytest.skip(INTERPRETER_SKIP)
        with triton_interpret_env():
            yield interpreted

    return interpreter


HAS_C = specdec_kernels.LOAD_ERROR is None
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_c = pytest.mark.skipif(not HAS_C, reason=f"specdec_kernels._C unavailable: {specdec_kernels.LOAD_ERROR}")

TREE_KINDS = ("chain", "star", "bushy", "deep", "random")


def cuda_kernel_marks(*ops: str) -> list:
    """`pytestmark` of a CUDA-kernel test module (python_tests/test_<op>_cuda.py): the `gpu`
    marker and a skip, saying why, unless a GPU is present and specdec_kernels._C has the
    compiled CUDA kernel of every op in `ops`."""
    if not HAS_CUDA:
        reason = "needs a CUDA GPU"
    else:
        missing = [op for op in ops if "cuda" not in specdec_kernels.available_backends(op, "cuda")]
        reason = (f"specdec_kernels._C has no CUDA kernel for {', '.join(missing)} (build it with "
                  "torch with CUDA and nvcc at build time: tools/gpu_session.sh build)") if missing else None
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


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


def tree_parents(gen, batch: int, num_nodes: int, kind: str, ragged: bool, shared_tree: bool) -> torch.Tensor:
    """random_parents for `batch` rows, or (shared_tree) one random tree repeated in every row."""
    if shared_tree:
        return random_parents(gen, 1, num_nodes, kind, ragged=ragged).expand(batch, -1).contiguous()
    return random_parents(gen, batch, num_nodes, kind, ragged=ragged)


def ancestors(parents_row, i: int) -> list:
    """Node i and its ancestors (i first), by walking parent links in plain Python."""
    out = [i]
    while parents_row[out[-1]] >= 0 and out[-1] != 0:
        out.append(int(parents_row[out[-1]]))
    return out


def sibling_tokens(gen, parents: torch.Tensor, vocab: int, choose) -> torch.Tensor:
    """int64 [B, T] tokens for a tree: a random root token per row, then node by node
    choose(b, p, taken) -> the token of the next child of node p in row b, where `taken` is
    the set of tokens p's earlier children got (padding nodes get -1)."""
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
            tok = choose(b, p, taken)
            taken.add(tok)
            tokens[b, i] = tok
    return tokens


def distinct_sibling_tokens(gen, parents: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64 [B, T] tokens with distinct tokens among siblings (padding nodes get -1)."""

    def uniform_untaken(b, p, taken):
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            raise ValueError(f"distinct_sibling_tokens: node {p} of row {b} has more children than the {vocab} tokens")
        return free[int(randint(gen, 0, len(free)))]

    return sibling_tokens(gen, parents, vocab, uniform_untaken)


def boundary_tie_case():
    """(logits [4, 1, 300], tokens, parents, top_k, top_p): a root-only tree whose logits tie
    six tokens (10..15) at the top and four (20..23) next, with top-k / top-p limits that fall
    inside the ties (3: keeps all 6 ties; 7 and 8: keeps the 4 next ties too; top-p 0.5)."""
    vocab = 300
    logits = torch.full((4, 1, vocab), -3.0)
    logits[:, 0, 10:16] = 2.0  # six tokens tied at the top
    logits[:, 0, 20:24] = 1.0  # four tied next
    tokens = torch.zeros(4, 1, dtype=torch.int64)
    parents = torch.tensor([-1])
    top_k = torch.tensor([3, 7, 8, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5])
    return logits, tokens, parents, top_k, top_p


# ----------------------------------------------------------------------------- verify backends vs reference


def drafted_tree_case(gen, batch, num_nodes, vocab, *, kind="random", with_probs=False, ragged=True, scale=2.0,
                      bump=10.0, sampled_token_range=None, nan_padding=False):
    """fp32 CPU (logits [B, T, V], tokens [B, T], parents [B, T], draft probs or None) where
    drafts are likely enough that paths go deep: each drafted token gets `bump` added to its
    parent's logit for it (and mass in q). With draft probs, siblings are i.i.d. from
    [0, sampled_token_range or V) (repeats allowed); without, siblings are distinct. With
    `nan_padding`, padding nodes hold NaN logits, so reading one as a path node shows."""
    parents = random_parents(gen, batch, num_nodes, kind, ragged=ragged)
    if with_probs:
        tokens = randint(gen, 0, sampled_token_range or vocab, (batch, num_nodes))
        tokens[parents < 0] = -1
        tokens[:, 0] = randint(gen, 0, vocab, (batch,))
    else:
        tokens = distinct_sibling_tokens(gen, parents, min(vocab, 50))
    logits = torch.randn(batch, num_nodes, vocab, generator=gen) * scale
    q = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen) * scale, -1) if with_probs else None
    for b in range(batch):
        for i in range(1, num_nodes):
            p = int(parents[b, i])
            if p >= 0:
                logits[b, p, tokens[b, i]] += bump
                if q is not None:
                    q[b, p, tokens[b, i]] += 0.3
    if q is not None:
        q = q / q.sum(-1, keepdim=True)
    if nan_padding:
        padding = parents < 0
        padding[:, 0] = False
        logits[padding] = float("nan")
    return logits, tokens, parents, q


def check_verify_invariants(out, tokens, parents, vocab):
    """A real path from the root, outputs padded with -1, emitted ids in [0, V), output dtypes."""
    acc, num, emitted = out.accepted_nodes.cpu(), out.num_accepted.cpu().long(), out.output_tokens.cpu()
    tokens, parents = tokens.cpu(), parents.cpu()
    assert out.accepted_nodes.dtype == torch.int32 and out.num_accepted.dtype == torch.int32
    assert out.output_tokens.dtype == torch.int64
    for b in range(tokens.shape[0]):
        n = int(num[b])
        assert acc[b, 0] == 0 and (acc[b, n + 1 :] == -1).all() and (emitted[b, n + 1 :] == -1).all()
        for d in range(1, n + 1):
            node = int(acc[b, d])
            assert parents[b, node] == acc[b, d - 1], f"row {b}: node {node} is not a child of {int(acc[b, d - 1])}"
            assert emitted[b, d - 1] == tokens[b, node]
        assert 0 <= int(emitted[b, n]) < vocab


def compare_verify(out, ref, greedy, tokens, parents, vocab, label="", sampled_rows_per_mismatch=None):
    """`out` against the reference output `ref`: invariants, greedy rows exactly, and at most
    max(1, sampled // sampled_rows_per_mismatch) sampled rows differing (1 when None).
    Returns the number of sampled rows that matched."""
    check_verify_invariants(out, tokens, parents, vocab)
    same = ((out.output_tokens.cpu() == ref.output_tokens.cpu()).all(1)
            & (out.num_accepted.cpu() == ref.num_accepted.cpu())
            & (out.accepted_nodes.cpu() == ref.accepted_nodes.cpu()).all(1))
    greedy = greedy.cpu()
    bad_greedy = torch.nonzero(greedy & ~same).flatten().tolist()
    assert not bad_greedy, f"{label}: greedy rows {bad_greedy} differ from the reference"
    sampled = int((~greedy).sum())
    mismatched = torch.nonzero(~greedy & ~same).flatten().tolist()
    allowed = 1 if sampled_rows_per_mismatch is None else max(1, sampled // sampled_rows_per_mismatch)
    assert len(mismatched) <= allowed, f"{label}: sampled rows {mismatched} of {sampled} differ from the reference"
    return sampled - len(mismatched)


def run_in_fresh_cpu_process(test_file: str, *pytest_args) -> None:
    """Run `test_file`'s tests in a fresh CPU-only pytest process (TRITON_INTERPRET unset, so
    conftest sets it up before anything imports triton) and assert they passed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", SPECDEC_TRITON_CHILD="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", os.path.abspath(test_file), *pytest_args],
        cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    defect = re.search(r"SKIPPED .*?: (triton \S+'s interpreter .*)", result.stdout)
    if " passed" not in result.stdout and defect:
        pytest.skip(defect.group(1))  # this triton cannot interpret them (INTERPRETER_DEFECT)
    assert " passed" in result.stdout and " failed" not in result.stdout


def max_gap_while(fn) -> float:
    """Longest pause (s) of a Python loop in this thread while `fn` runs in another: short when
    `fn` releases the GIL (the GIL-release tests of the host indexes)."""
    thread = threading.Thread(target=fn)
    gaps, last = [], time.perf_counter()
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    return max(gaps)
