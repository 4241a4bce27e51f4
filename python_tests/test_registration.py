"""Op registration and dispatch: `torch.library.opcheck` on every `torch.ops.specdec` op,
`torch.compile(fullgraph=True)` through the public API, backend selection, and importing the
package without the compiled extension."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.ops import _extension

from conftest import HAS_C, randint, random_parents, requires_c
from test_paged import paged_attention_samples, paged_compact_samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = _extension.OPS


# ----------------------------------------------------------------------------- sample inputs
# The normalised argument forms the public wrappers pass to `dispatch(...)`.


def tree_mask_samples(gen):
    for batch, num_nodes, kind in ((1, 1, "chain"), (3, 7, "random"), (2, 70, "bushy")):
        yield (random_parents(gen, batch, num_nodes, kind),)
    wide = torch.zeros(2, 18, dtype=torch.int64)
    wide[:, ::2] = random_parents(gen, 2, 9, "deep")
    yield (wide[:, ::2],)  # strided (the public API passes contiguous; the op must not care)


def pack_tree_mask_samples(gen):
    for batch, num_nodes in ((1, 1), (2, 9), (2, 65), (1, 130)):
        mask = sk.tree_mask(random_parents(gen, batch, num_nodes, "random"))
        yield (mask,)
    yield (torch.rand(2, 5, 70, generator=gen) < 0.5,)  # not square
    yield (sk.tree_mask(random_parents(gen, 2, 66, "random")).transpose(1, 2),)  # strided


def attention_inputs(gen, batch, num_nodes, q_heads, kv_heads, head_dim, dtype=torch.float32, packed=False, hf=False):
    parents = random_parents(gen, batch, num_nodes, "random")
    prefix = randint(gen, 0, 20, (batch,)).to(torch.int32)
    cache_len = int(prefix.max()) + num_nodes + 2
    if hf:
        q = torch.randn(batch, q_heads, num_nodes, head_dim, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(batch, kv_heads, cache_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(batch, kv_heads, cache_len, head_dim, generator=gen).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(batch, cache_len, kv_heads, head_dim, generator=gen).to(dtype)
    mask = sk.tree_mask(parents)
    if packed:
        mask = sk.pack_tree_mask(mask)
    return q, k, v, mask, prefix, head_dim**-0.5


def tree_attention_samples(gen):
    yield attention_inputs(gen, 2, 5, 4, 2, 16)
    yield attention_inputs(gen, 1, 1, 2, 2, 8, dtype=torch.bfloat16)
    yield attention_inputs(gen, 2, 66, 2, 1, 16, packed=True)
    yield attention_inputs(gen, 2, 6, 4, 4, 16, dtype=torch.float16)
    # window, softcap (the schema's trailing arguments) and a value head dim of its own (MLA)
    q, k, v, mask, prefix, scale = attention_inputs(gen, 2, 7, 4, 2, 16)
    yield q, k, v[..., :8].contiguous(), mask, prefix, scale, 3, 20.0
    q, k, v, mask, prefix, scale = attention_inputs(gen, 2, 6, 2, 1, 16, dtype=torch.bfloat16, packed=True)
    yield q, k, torch.cat([v, v], dim=-1), mask, prefix, scale, 40, 0.0


def tree_attention_hf_samples(gen):
    yield attention_inputs(gen, 2, 5, 4, 2, 16, hf=True)


def verify_samples(gen):
    batch, num_nodes, vocab = 2, 6, 11
    parents = random_parents(gen, batch, num_nodes, "random")
    def f_verify_int_seed(logits, tokens, parents):
        # An int seed: the per-row seeds are derived inside the traced call (a Philox draw).
        out = sk.verify(logits, tokens, parents, temperature=torch.tensor([0.0, 1.0]), seed=7)
        return out.accepted_nodes, out.num_accepted, out.output_tokens

    from conftest import distinct_sibling_tokens

    tokens = distinct_sibling_tokens(gen, parents, vocab)
    logits = torch.randn(batch, num_nodes, vocab, generator=gen)
    seed = torch.tensor([1, 2], dtype=torch.int64)
    temp = torch.tensor([0.0, 0.8])
    top_k = torch.tensor([0, 5])
    top_p = torch.tensor([1.0, 0.9])
    yield (logits, tokens, parents, None, temp, top_k, top_p, seed)
    draft = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=gen), -1)
    yield (logits, tokens, parents, draft, torch.tensor([1.0, 0.5]), torch.zeros(2, dtype=torch.int64), torch.ones(2), seed)


def compact_samples(gen):
    batch, num_nodes = 2, 5
    prefix = torch.tensor([3, 0], dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 3, -1, -1], [0, -1, -1, -1, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 0], dtype=torch.int32)
    caches = [torch.randn(batch, 10, 2, 4, generator=gen), torch.randn(batch, 2, 9, 8, generator=gen).to(torch.bfloat16).transpose(1, 2)]
    yield (caches, prefix, accepted, num_accepted)


def ngram_tokens(gen):
    tokens = randint(gen, 0, 4, (3, 40))
    lengths = torch.tensor([40, 0, 17])
    return tokens, lengths


def ngram_propose_samples(gen):
    tokens, lengths = ngram_tokens(gen)
    yield (tokens, lengths, 1, 4, 5, "earliest")
    yield (tokens.to(torch.int32), lengths, 2, 2, 3, "latest")


def ngram_propose_tree_samples(gen):
    tokens, lengths = ngram_tokens(gen)
    yield (tokens, lengths, 1, 3, 4, 3, 12, "earliest")
    yield (tokens.to(torch.int32), lengths, 1, 1, 2, 2, 3, "latest")


SAMPLES = {
    "tree_mask": tree_mask_samples,
    "pack_tree_mask": pack_tree_mask_samples,
    "tree_attention": tree_attention_samples,
    "verify": verify_samples,
    "compact_kv_cache_": compact_samples,
    "ngram_propose": ngram_propose_samples,
    "ngram_propose_tree": ngram_propose_tree_samples,
    "tree_attention_paged": paged_attention_samples,
    "compact_kv_cache_paged_": paged_compact_samples,
}


def clone_args(args):
    return tuple([a.clone() for a in x] if isinstance(x, list) else x.clone() if isinstance(x, torch.Tensor) else x for x in args)


# ----------------------------------------------------------------------------- opcheck


@requires_c
def test_every_op_is_registered():
    for op in OPS:
        packet = getattr(torch.ops.specdec, op)
        assert packet.default is not None
        for key in ("CPU",):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"specdec::{op}", key), (op, key)
    assert set(OPS) == set(SAMPLES)


@requires_c
@pytest.mark.parametrize("op", OPS)
def test_opcheck(gen, op):
    for args in SAMPLES[op](gen):
        torch.library.opcheck(getattr(torch.ops.specdec, op).default, clone_args(args))


OUTPUT_ROUNDING = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@requires_c
@pytest.mark.parametrize("op", OPS)
def test_op_matches_reference(gen, op):
    """torch.ops.specdec.<op> (compiled or registered reference kernel) == reference function."""
    for args in SAMPLES[op](gen):
        a, b = clone_args(args), clone_args(args)
        got = getattr(torch.ops.specdec, op).default(*a)
        want = getattr(sk.reference, op)(*b)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape
            # 16-bit outputs may differ by one output rounding (another summation order).
            tol = OUTPUT_ROUNDING.get(x.dtype, dict(atol=1e-5, rtol=1e-5))
            torch.testing.assert_close(x, y, **tol)
        if op == "compact_kv_cache_":
            for x, y in zip(a[0], b[0]):
                assert torch.equal(x, y)


@requires_c
def test_opcheck_tree_attention_hf_layout(gen):
    for args in tree_attention_hf_samples(gen):
        torch.library.opcheck(torch.ops.specdec.tree_attention.default, clone_args(args))


def test_tree_attention_output_strides_do_not_depend_on_backend(gen):
    """The fake says contiguous: every backend must return a contiguous output, for any q layout."""
    for args in tree_attention_samples(gen):
        q, k, v, mask, prefix, scale, *options = args
        window, softcap = (options[0] or None, options[1] or None) if options else (None, None)
        for backend in [None] + sk.available_backends("tree_attention", "cpu"):
            out = sk.tree_attention(q, k, v, mask, prefix, scale=scale, window=window, softcap=softcap, backend=backend)
            assert out.is_contiguous()


def test_tree_attention_output_contiguous_for_hf_q(gen):
    for args in tree_attention_hf_samples(gen):
        q, k, v, mask, prefix, scale = args
        for backend in [None] + sk.available_backends("tree_attention", "cpu"):
            assert sk.tree_attention(q, k, v, mask, prefix, scale=scale, backend=backend).is_contiguous()


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


COMPILED_BAD_CALLS = [
    ("tree_mask", "parents", lambda: (torch.tensor([[-1, 0]], dtype=torch.int32),)),
    ("tree_mask", "parents", lambda: (torch.tensor([-1, 0]),)),
    ("tree_mask", "parents", lambda: (torch.tensor([[-1, 0, 5]]),)),  # not topological: a value check in the kernel
    ("tree_mask", "parents", lambda: (torch.tensor([[-1, 0, -3]]),)),
    ("tree_mask", "parents", lambda: (torch.tensor([[2, 0, 1]]),)),
    ("pack_tree_mask", "mask", lambda: (torch.zeros(1, 2, 2, dtype=torch.int64),)),
    ("pack_tree_mask", "mask", lambda: (torch.zeros(2, 2, dtype=torch.bool),)),
    ("compact_kv_cache_", "cache_seqlens", lambda: ([torch.zeros(1, 5, 1, 2)], torch.tensor([0]), _i32([0, 1]), _i32(1))),
    ("compact_kv_cache_", "caches", lambda: ([torch.zeros(1, 5, 2)], _i32(0), _i32([0, 1]), _i32(1))),
    ("compact_kv_cache_", "accepted_nodes", lambda: ([torch.zeros(1, 5, 1, 2)], _i32(0), _i32([0, 7]), _i32(1))),
    ("compact_kv_cache_", "cache_seqlens", lambda: ([torch.zeros(1, 5, 1, 2)], _i32(4), _i32([0, 1]), _i32(1))),
    ("compact_kv_cache_", "num_accepted", lambda: ([torch.zeros(1, 5, 1, 2)], _i32(0), _i32([0, 1]), _i32(2))),
]


@requires_c
@pytest.mark.parametrize("op, name, make_args", COMPILED_BAD_CALLS, ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(COMPILED_BAD_CALLS)])
def test_compiled_kernels_check_direct_calls(op, name, make_args):
    """torch.ops.specdec.<op> called directly (no Python checks) fails with an error naming the op
    and the argument, never a crash or a wrong answer."""
    if "CPU" not in _extension.COMPILED[op]:
        pytest.skip(f"no compiled CPU kernel for {op}")
    with pytest.raises(RuntimeError, match=rf"{op}.*{name}"):
        getattr(torch.ops.specdec, op).default(*make_args())


# ----------------------------------------------------------------------------- torch.compile


@pytest.fixture
def no_value_checks():
    old = sk.config.check_values
    sk.config.check_values = False
    try:
        yield
    finally:
        sk.config.check_values = old


def _public_calls(gen):
    """(name, fn, [args for two shapes]) for a small function around each public op."""
    def f_tree(parents):
        mask = sk.tree_mask(parents)
        return mask, sk.pack_tree_mask(mask)

    def f_attention(q, k, v, parents, prefix):
        mask = sk.tree_mask(parents)
        return sk.tree_attention(q, k, v, mask, prefix) + 1, sk.tree_attention(q, k, v, sk.pack_tree_mask(mask), prefix, scale=0.1)

    def f_compact(c0, c1, prefix, accepted, num_accepted):
        return sk.compact_kv_cache_([c0, c1], prefix, accepted, num_accepted) * 2

    def f_ngram(tokens, lengths):
        drafts, lens = sk.ngram_propose(tokens, lengths, min_n=1, max_n=3, num_tokens=4)
        tree = sk.ngram_propose_tree(tokens, lengths, min_n=1, max_n=3, num_tokens=4, tree_width=2, policy="latest")
        return drafts, lens, tree.tokens, tree.parents

    def f_verify(logits, tokens, parents):
        out = sk.verify(logits, tokens, parents, temperature=0.0, seed=torch.tensor([3, 4]))
        return out.accepted_nodes, out.num_accepted, out.output_tokens

    def f_verify_int_seed(logits, tokens, parents):
        # An int seed: the per-row seeds are derived inside the traced call (a Philox draw).
        out = sk.verify(logits, tokens, parents, temperature=torch.tensor([0.0, 1.0]), seed=7)
        return out.accepted_nodes, out.num_accepted, out.output_tokens

    from conftest import distinct_sibling_tokens

    def attn_args(num_nodes):
        q, k, v, _, prefix, _ = attention_inputs(gen, 2, num_nodes, 4, 2, 16)
        return (q, k, v, random_parents(gen, 2, num_nodes, "random"), prefix)

    def compact_args(num_nodes):
        accepted = torch.full((2, num_nodes), -1, dtype=torch.int32)
        accepted[0, :3], accepted[1, 0] = torch.tensor([0, 1, num_nodes - 1]), 0
        return (torch.randn(2, 20, 2, 4, generator=gen), torch.randn(2, 3, 20, 8, generator=gen).transpose(1, 2),
                torch.tensor([4, 9], dtype=torch.int32), accepted, torch.tensor([2, 0], dtype=torch.int32))

    def verify_args(num_nodes):
        parents = random_parents(gen, 2, num_nodes, "random")
        return (torch.randn(2, num_nodes, 9, generator=gen), distinct_sibling_tokens(gen, parents, 9), parents)

    return [
        ("tree", f_tree, [(random_parents(gen, 2, t, "random"),) for t in (5, 67)]),
        ("attention", f_attention, [attn_args(t) for t in (4, 9)]),
        ("compact", f_compact, [compact_args(t) for t in (4, 6)]),
        ("ngram", f_ngram, [(randint(gen, 0, 4, (2, n)), torch.tensor([n, n // 2])) for n in (30, 50)]),
        ("verify", f_verify, [verify_args(t) for t in (4, 7)]),
        ("verify_int_seed", f_verify_int_seed, [verify_args(t) for t in (4, 7)]),
    ]


def _check_compiled(fn, arg_sets, compile_backend):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)
    for args in arg_sets:
        eager_args, compiled_args = clone_args(args), clone_args(args)
        want = fn(*eager_args)
        got = compiled(*compiled_args)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        for x, y in zip(compiled_args, eager_args):  # in-place ops mutate the same way
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)


@requires_c
@pytest.mark.parametrize("name", ("tree", "attention", "compact", "ngram", "verify", "verify_int_seed"))
def test_compile_fullgraph(gen, no_value_checks, name):
    fn, arg_sets = next((f, a) for n, f, a in _public_calls(gen) if n == name)
    _check_compiled(fn, arg_sets, "aot_eager")


@requires_c
# Ops only, no generated C++ to compile, so it stays fast; verify_int_seed: an int seed's Philox
# rounds traced inline were a graph of constants inductor did not finish compiling in 10 min.
@pytest.mark.parametrize("name", ("tree", "verify_int_seed"))
def test_compile_fullgraph_inductor(gen, no_value_checks, name):
    fn, arg_sets = next((f, a) for n, f, a in _public_calls(gen) if n == name)
    _check_compiled(fn, arg_sets, "inductor")


@requires_c
def test_compile_value_checks_skipped_but_flag_restored(gen):
    """With check_values left on, compiling still works: the value checks are skipped while tracing."""
    assert sk.config.check_values
    parents = random_parents(gen, 2, 9, "random")
    compiled = torch.compile(lambda p: sk.tree_mask(p), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    assert torch.equal(compiled(parents), sk.tree_mask(parents))


# ----------------------------------------------------------------------------- backends


def _public_call(op, gen, backend):
    """Call the public entry point of `op` with small valid inputs and a forced backend."""
    if op == "tree_mask":
        return sk.tree_mask(random_parents(gen, 2, 5, "random"), backend=backend)
    if op == "pack_tree_mask":
        return sk.pack_tree_mask(sk.tree_mask(random_parents(gen, 2, 5, "random")), backend=backend)
    if op == "tree_attention":
        q, k, v, mask, prefix, _ = attention_inputs(gen, 2, 5, 2, 1, 8)
        return sk.tree_attention(q, k, v, mask, prefix, backend=backend)
    if op == "verify":
        logits = torch.randn(1, 3, 5, generator=gen)
        return sk.verify(logits, torch.tensor([[0, 1, 2]]), torch.tensor([-1, 0, 0]), temperature=0.0, backend=backend)
    if op == "compact_kv_cache_":
        (caches, prefix, accepted, num_accepted), = compact_samples(gen)
        return sk.compact_kv_cache_(caches, prefix, accepted, num_accepted, backend=backend)
    if op == "ngram_propose":
        return sk.ngram_propose(*ngram_tokens(gen), backend=backend)
    if op == "ngram_propose_tree":
        return sk.ngram_propose_tree(*ngram_tokens(gen), backend=backend)
    if op == "tree_attention_paged":
        q, k, v, mask, prefix, table, scale = next(paged_attention_samples(gen))
        return sk.tree_attention(q, k, v, mask, prefix, block_table=table, scale=scale, backend=backend)
    if op == "compact_kv_cache_paged_":
        (caches, prefix, accepted, num_accepted, table), = paged_compact_samples(gen)
        return sk.compact_kv_cache_(caches, prefix, accepted, num_accepted, block_table=table, backend=backend)
    raise AssertionError(op)


@pytest.mark.parametrize("op", OPS)
def test_available_backends(op):
    cpu = sk.available_backends(op, "cpu")
    assert cpu[-1] == "reference" and len(set(cpu)) == len(cpu)
    assert set(cpu) <= {"cpu", "reference"}
    assert ("cpu" in cpu) == ("CPU" in _extension.COMPILED[op])
    if not HAS_C:
        assert cpu == ["reference"]
    cuda = sk.available_backends(op, "cuda")
    assert "reference" in cuda and len(set(cuda)) == len(cuda) and set(cuda) <= {"cuda", "triton", "reference"}


@requires_c
def test_compiled_cpu_kernels_present():
    """The extension ships compiled CPU kernels for these ops (the brief of the C++ side)."""
    for op in ("tree_mask", "pack_tree_mask", "compact_kv_cache_"):
        assert sk.available_backends(op, "cpu")[0] == "cpu", op


@requires_c
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF symbol tables: Linux only")
def test_extension_does_not_export_a_cpp_runtime():
    """`_C` must not carry its own exported copy of the C++ runtime: a g++ that links libstdc++
    statically (the GPU machines' /opt/gcc) made every failing TORCH_CHECK segfault (setup.py
    links with -Wl,--exclude-libs,ALL; bench/results/gpu/throw_probe/)."""
    import shutil
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs binutils' nm")
    path = _extension._C.__file__
    symbols = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    runtime = [line.split()[-1] for line in symbols.splitlines()
               if line.split()[-1].startswith(("__cxa_throw", "__cxa_begin_catch", "__gxx_personality"))]
    assert not runtime, f"{path} exports C++ runtime symbols {runtime}"


def test_failing_check_in_the_extension_raises():
    """A TORCH_CHECK failing inside `_C` reaches Python as RuntimeError (it once segfaulted)."""
    if "CPU" not in _extension.COMPILED["verify"]:
        pytest.skip("no compiled CPU verify kernel")
    logits = torch.randn(2, 3, 11)
    ones, zeros = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="tree_tokens must have dtype Long"):
        torch.ops.specdec.verify.default(logits, torch.zeros(2, 3, dtype=torch.int32), torch.tensor([[-1, 0, 1]] * 2),
                                         None, ones, zeros, ones, zeros)


@pytest.mark.parametrize("op", OPS)
def test_forced_backends(gen, op):
    _public_call(op, gen, "reference")
    _public_call(op, gen, None)
    if "cpu" in sk.available_backends(op, "cpu"):
        _public_call(op, gen, "cpu")
    else:
        with pytest.raises(RuntimeError, match=op):
            _public_call(op, gen, "cpu")
    with pytest.raises(ValueError, match="nope"):
        _public_call(op, gen, "nope")
    with pytest.raises(ValueError, match="cuda"):  # CPU tensors
        _public_call(op, gen, "cuda")
    if op in _extension.TRITON_OPS and _extension.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        _public_call(op, gen, "triton")  # interpreted on CPU (test_tree_attention_triton.py checks the values)
    else:
        with pytest.raises(RuntimeError, match="triton"):  # no kernel, no triton, or CPU tensors uninterpreted
            _public_call(op, gen, "triton")


# ----------------------------------------------------------------------------- import without _C


def _run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def _run_python_expecting_ok(code: str) -> None:
    """Runs `code` in a fresh interpreter: it must exit 0 and print OK, or print SKIP <why>
    (the test is then skipped with that reason)."""
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP"):
        pytest.skip(result.stdout.strip())
    assert "OK" in result.stdout


_USE_PACKAGE = """
    import torch
    assert sk.available_backends("tree_mask", "cpu") == ["reference"]
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])
    mask = sk.tree_mask(parents)
    assert mask.tolist()[0][3] == [True, True, False, True], mask
    assert sk.pack_tree_mask(mask).shape == (2, 4, 1)
    d, n = sk.ngram_propose(torch.tensor([[1, 2, 1]]), torch.tensor([3]))
    assert d.tolist()[0][:2] == [2, 1] and n.tolist() == [2]
    try:
        sk.tree_mask(parents, backend="cpu")
    except RuntimeError as e:
        assert "tree_mask" in str(e) and REASON in str(e), e
    else:
        raise AssertionError("backend='cpu' should fail without _C")
    import specdec_kernels, importlib  # importing again does not warn again
    importlib.import_module("specdec_kernels")
    ours = [w for w in caught if "specdec_kernels" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert ours[0].category is RuntimeWarning
    assert "specdec_kernels._C" in message and REASON in message and "reference" in message, message
    assert "pip install" in message, message
    print("OK", sk.LOAD_ERROR)
"""


def test_import_without_extension_warns_once():
    code = """
        import sys, warnings
        sys.modules["specdec_kernels._C"] = None  # as if it was never built
        REASON = "not built"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import specdec_kernels as sk
            assert sk.LOAD_ERROR == "it was not built", sk.LOAD_ERROR
    """ + textwrap.indent(textwrap.dedent(_USE_PACKAGE), " " * 12)
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert "OK it was not built" in result.stdout


def test_import_with_broken_extension_warns_once():
    """An extension that fails to load (e.g. built against another torch) is reported, not raised."""
    code = """
        import importlib.abc, importlib.util, sys, warnings

        class Broken(importlib.abc.Loader):
            def create_module(self, spec):
                raise ImportError("undefined symbol: _ZN3c1017fake_missing_symbolEv")
            def exec_module(self, module):
                pass

        class Finder(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "specdec_kernels._C":
                    return importlib.util.spec_from_loader(name, Broken())
                return None

        sys.meta_path.insert(0, Finder())
        REASON = "undefined symbol"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import specdec_kernels as sk
            assert "failed to load" in sk.LOAD_ERROR and "ImportError" in sk.LOAD_ERROR, sk.LOAD_ERROR
    """ + textwrap.indent(textwrap.dedent(_USE_PACKAGE), " " * 12)
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert "OK it failed to load: ImportError: undefined symbol" in result.stdout


@requires_c
def test_import_with_extension_does_not_warn():
    result = _run_python(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import specdec_kernels as sk
        assert sk.LOAD_ERROR is None
        assert not [w for w in caught if "specdec_kernels" in str(w.message)], [str(w.message) for w in caught]
        assert sk.available_backends("tree_mask", "cpu") == ["cpu", "reference"]
        print("OK")
        """
    )
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


# ----------------------------------------------------------------------------- config.triton_by_default


def test_triton_by_default_is_read_at_run_time(monkeypatch):
    """Flipping the setting changes the CUDA preference order and what the CUDA kernel registered
    for ops without a compiled one runs, with no re-import (it used to be fixed at import)."""
    monkeypatch.setattr(_extension, "HAS_TRITON", True)  # the order as if triton were installed
    calls = []
    monkeypatch.setattr(_extension, "triton_kernel", lambda op: lambda *args: calls.append(("triton", op)))
    monkeypatch.setattr(sk.reference, "verify", lambda *args: calls.append(("reference", "verify")))
    kernel = _extension._cuda_python_kernel("verify")
    compiled = ["cuda"] if "CUDA" in _extension.COMPILED["verify"] else []
    monkeypatch.setattr(sk.config, "triton_by_default", False)
    assert sk.available_backends("verify", "cuda") == compiled + ["reference", "triton"]
    kernel()
    monkeypatch.setattr(sk.config, "triton_by_default", True)
    assert sk.available_backends("verify", "cuda") == compiled + ["triton", "reference"]
    kernel()
    assert calls == [("reference", "verify"), ("triton", "verify")]
    assert "triton" not in sk.available_backends("tree_mask", "cuda")  # no Triton kernel for it


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, True)])
def test_triton_by_default_from_environment(value, expected):
    """On unless SPECDEC_TRITON_BY_DEFAULT=0 at import (the Triton kernels passed on a GPU)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("SPECDEC_TRITON_BY_DEFAULT", None)
    if value is not None:
        env["SPECDEC_TRITON_BY_DEFAULT"] = value
    result = subprocess.run([sys.executable, "-c", "import specdec_kernels as sk; print(sk.config.triton_by_default)"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected)


# ----------------------------------------------------------------------------- dispatch


@requires_c
def test_dispatch_under_fake_tensors_uses_the_fake_implementations(gen):
    """dispatch calls Python kernels directly (no trip through the dispatcher) only for plain
    tensors outside any dispatch mode: under FakeTensorMode the ops still go through torch.ops
    and their fake implementations (shapes only, no data-dependent reference code)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, mask, prefix, _ = attention_inputs(gen, 2, 5, 4, 2, 16)
    logits, parents = torch.randn(2, 5, 9), random_parents(gen, 2, 5, "random")
    tokens = torch.zeros(2, 5, dtype=torch.int64)
    with sk.config.value_checks(False), FakeTensorMode() as mode:
        fq, fk, fv, fmask, fprefix, flogits, ftokens, fparents = (
            mode.from_tensor(x) for x in (q, k, v, mask, prefix, logits, tokens, parents))
        out = sk.tree_attention(fq, fk, fv, fmask, fprefix)
        assert out.shape == q.shape and out.dtype == q.dtype
        verified = sk.verify(flogits, ftokens, fparents, temperature=0.0, seed=torch.tensor([1, 2]))
        assert verified.accepted_nodes.shape == (2, 5) and verified.num_accepted.shape == (2,)


def test_dispatch_decision_is_cached_per_op_device_backend():
    """The kernel for (op, device type, backend, triton setting) is decided once; errors are not cached."""
    parents = torch.tensor([[-1, 0, 0]])
    sk.tree_mask(parents)
    key = ("tree_mask", "cpu", None, sk.config.triton_by_default)
    assert _extension._KERNELS[key] is _extension._resolve("tree_mask", "cpu", None, parents.device)
    sk.tree_mask(parents, backend="reference")
    assert _extension._KERNELS[("tree_mask", "cpu", "reference", sk.config.triton_by_default)] is sk.reference.tree_mask
    for _ in range(2):  # a bad backend raises every time
        with pytest.raises(ValueError, match="backend"):
            sk.tree_mask(parents, backend="nope")


def test_profiles_name_every_backend_alike():
    """Under a profiler, an op run by the reference (what CUDA tensors get by default) or by a
    compiled kernel appears as specdec::<op> (bench e2e's kernel share counts those events);
    without a profiler nothing is added."""
    from torch.profiler import profile

    parents = torch.tensor([[-1, 0, 0, 1]])
    backends = ["reference"] + (["cpu"] if HAS_C else [])
    for backend in backends:
        with profile() as prof:
            sk.tree_mask(parents, backend=backend)
        names = [e.name for e in prof.events()]
        assert names.count("specdec::tree_mask") == 1, (backend, [n for n in names if "specdec" in n])


# ----------------------------------------------------------------------------- CUDA tensors on the reference


def test_cuda_fallback_to_reference_warns_once():
    """A GPU user whose build lacks the CUDA kernels (and whose Triton path is off) is told once,
    with what is missing and how to fix it, instead of silently running the slow reference. The
    dispatch decision is made for device type "cuda" directly, so this runs without a GPU."""
    code = """
        import warnings, torch
        import specdec_kernels as sk
        from specdec_kernels.ops import _extension
        cuda = torch.device("cuda")
        ops = [op for op in _extension.OPS if "CUDA" not in _extension.COMPILED[op]]
        if not ops:
            print("SKIP every op has a compiled CUDA kernel")
            raise SystemExit
        sk.config.triton_by_default = False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for op in ops:
                assert _extension._resolve(op, "cuda", None, cuda) is getattr(sk.reference, op)
            _extension._cuda_python_kernel(ops[0])  # the torch.ops route (compiled graphs) warns through the same flag
        ours = [w for w in caught if "plain-torch reference" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        message = str(ours[0].message)
        assert ours[0].category is RuntimeWarning and ops[0] in message, message
        assert "pip install" in message and ("without CUDA kernels" in message or "unavailable" in message), message
        if ops[0] in _extension.TRITON_OPS:
            assert ("triton_by_default" in message) if _extension.HAS_TRITON else ("pip install triton" in message)
        assert _extension._resolve("tree_mask", "cpu", None, torch.device("cpu")) is not None  # CPU: no warning
        print("OK")
    """
    _run_python_expecting_ok(code)


def test_cuda_fallback_warning_names_the_triton_switch_for_triton_ops():
    """For an op with a Triton kernel, turning the switch on removes the fallback (no warning)."""
    code = """
        import warnings, torch
        from specdec_kernels import config
        from specdec_kernels.ops import _extension
        if "CUDA" in _extension.COMPILED["verify"] or not _extension.HAS_TRITON:
            print("SKIP compiled CUDA verify, or no triton")
            raise SystemExit
        _extension.triton_kernel = lambda op: ("triton", op)  # not imported: no GPU here
        config.triton_by_default = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _extension._resolve("verify", "cuda", None, torch.device("cuda")) == ("triton", "verify")
        assert not [w for w in caught if "plain-torch reference" in str(w.message)]
        print("OK")
    """
    _run_python_expecting_ok(code)
