"""The Triton tree_attention kernel against the reference (and the float64 oracles).

On a machine without CUDA the kernels run in the Triton interpreter, in this process:
conftest.py imports triton with TRITON_INTERPRET=1 (triton picks interpreter or compiler
when each @triton.jit function is defined), this module imports the kernel module the same
way, and the `interpreter` fixture sets the variable only while this module's tests run, so
other modules still see `backend="triton"` refused on CPU tensors. Shapes stay small: the
interpreter runs every program in numpy. Where that is impossible (a CUDA machine, or triton
imported first without the variable) one test reruns them in a fresh CPU-only process.
Without a GPU we also compile the kernels for sm_80 / sm_90 (no launch). On a CUDA machine
the GPU tests run bf16/fp16 at realistic sizes. Everything skips cleanly without triton.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import pack_tree_mask, reference, tree_attention, tree_mask
from specdec_kernels.ops import _extension

from conftest import (HAS_CUDA, import_interpreted_kernels, interpreter_fixture, randint, random_parents, requires_cuda,
                      run_in_fresh_cpu_process)
from test_tree_attention import TOL, brute_attention, branch_oracle, make_case

HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
KERNEL_MODULE = "specdec_kernels.ops.triton.tree_attention"

# The kernel keeps probabilities in the input dtype for the P @ V product (like flash
# attention), so 16-bit outputs may differ from the reference by a little more than one
# output rounding: use the float64-oracle tolerances of test_tree_attention.
TOL_VS_REFERENCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: TOL[torch.float16],
    torch.bfloat16: TOL[torch.bfloat16],
}


INTERPRETED = import_interpreted_kernels(KERNEL_MODULE)

interpreter = interpreter_fixture(INTERPRETED)


def check(module, q, k, v, mask, prefix, *, scale=None, num_splits=None, parents=None, gen=None):
    """Triton (public API, and the kernel with forced splits) against the reference."""
    scale_value = q.shape[-1] ** -0.5 if scale is None else scale
    full_mask = mask if mask.dim() == 3 else mask.unsqueeze(0).expand(q.shape[0], -1, -1)
    ref = reference.tree_attention(q, k, v, full_mask, prefix, scale_value)
    if num_splits is None:
        out = tree_attention(q, k, v, mask, prefix, scale=scale, backend="triton")
    else:
        out = module.tree_attention(q, k, v, full_mask, prefix, scale_value, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL_VS_REFERENCE[q.dtype])
    if parents is not None:
        expected = brute_attention(q, k, v, parents, prefix, scale)
        torch.testing.assert_close(out.double(), expected, **TOL[q.dtype])
    return out


# ----------------------------------------------------------------------------- interpreter (CPU)


@pytest.mark.parametrize("num_nodes", (1, 5, 17, 64))
@pytest.mark.parametrize("kind", ("chain", "star", "random"))
def test_tree_kinds(interpreter, gen, kind, num_nodes):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=num_nodes, q_heads=4, kv_heads=1, head_dim=64, kind=kind,
                                         max_prefix=60)
    check(interpreter, q, k, v, tree_mask(parents), prefix)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2), (8, 1)], ids=("mha", "gqa4", "gqa8"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_gqa_head_dims_dtypes(interpreter, gen, dtype, q_heads, kv_heads, head_dim):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=int(randint(gen, 1, 9)), q_heads=q_heads, kv_heads=kv_heads,
                                         head_dim=head_dim, dtype=dtype, max_prefix=90)
    check(interpreter, q, k, v, pack_tree_mask(tree_mask(parents)), prefix)


@pytest.mark.parametrize("num_splits", (2, 5))
def test_ragged_prefixes_split_kv(interpreter, gen, num_splits):
    """Prefixes 0 .. 200 in one batch, the prefix split over several programs and merged."""
    prefix = torch.tensor([200, 0, 1, int(randint(gen, 2, 200))])
    q, k, v, parents, prefix = make_case(gen, batch=4, num_nodes=5, q_heads=8, kv_heads=2, head_dim=64, prefix=prefix)
    strided = torch.zeros(8, dtype=torch.int32)
    strided[::2] = prefix
    check(interpreter, q, k, v, tree_mask(parents), strided[::2], num_splits=num_splits, parents=parents)


@pytest.mark.parametrize("form", ("bool", "bool_shared", "packed", "packed_shared"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
def test_hf_views_and_mask_forms(interpreter, gen, dtype, form):
    """Transposed [B, H, S, D] views, and every mask form (shared: stride-0 batch)."""
    shared = form.endswith("shared")
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=17, q_heads=8, kv_heads=2, head_dim=64, dtype=dtype,
                                         hf_layout=True, shared_tree=shared, max_prefix=100)
    assert not k.is_contiguous() and not q.is_contiguous()
    mask = tree_mask(parents[0] if shared else parents)
    if form.startswith("packed"):
        mask = pack_tree_mask(mask)
    check(interpreter, q, k, v, mask, prefix, num_splits=2 if form == "packed" else None)


def test_wide_tree_two_mask_words_and_tiles(interpreter, gen):
    """T = 70 > 64: two packed words per node and two tree tiles of keys."""
    q, k, v, parents, prefix = make_case(gen, batch=1, num_nodes=70, q_heads=2, kv_heads=1, head_dim=64, max_prefix=30)
    check(interpreter, q, k, v, pack_tree_mask(tree_mask(parents)), prefix, parents=parents)


def test_bf16_computed_in_fp32(interpreter, gen):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=64,
                                         dtype=torch.bfloat16, max_prefix=50)
    check(interpreter, q, k, v, tree_mask(parents), prefix, parents=parents)


def test_per_branch_oracle(interpreter, gen):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=17, q_heads=8, kv_heads=2, head_dim=64, kind="bushy",
                                         max_prefix=150)
    out = check(interpreter, q, k, v, tree_mask(parents), prefix, num_splits=3, parents=parents)
    oracle = branch_oracle(q, k, v, parents, prefix, nodes_per_row=10**9, gen=gen)
    for (b, node), want in oracle.items():
        torch.testing.assert_close(out[b, node].double(), want, **TOL[torch.float32])


def test_custom_scale_and_odd_head_dim(interpreter, gen):
    """A head dim that is not a power of two is padded (masked) to the next one."""
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=6, q_heads=4, kv_heads=2, head_dim=80, max_prefix=40)
    check(interpreter, q, k, v, tree_mask(parents), prefix, scale=0.3, parents=parents)


def test_garbage_nan_outside_visible_region(interpreter, gen):
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=5, q_heads=4, kv_heads=1, head_dim=64, max_prefix=70)
    mask = tree_mask(parents)
    scale = 64**-0.5
    clean = {splits: interpreter.tree_attention(q, k, v, mask, prefix, scale, num_splits=splits) for splits in (1, 3)}
    for b in range(2):
        end = int(prefix[b]) + 5
        k[b, end:] = float("nan")
        v[b, end:] = float("nan")
    for splits in (1, 3):
        out = check(interpreter, q, k, v, mask, prefix, num_splits=splits)
        torch.testing.assert_close(out, clean[splits], atol=0, rtol=0)


@pytest.mark.parametrize("num_splits", (1, 3))
def test_nan_in_nan_out(interpreter, gen, num_splits):
    """The documented NaN contract (tree_attention's docstring, as the reference): NaN in q or in
    what a query sees makes that query NaN, and only it, with or without split-KV."""
    from test_tree_attention import nan_cases

    mask, prefix, cases = nan_cases(gen)
    for name, q, k, v, want in cases:
        clean_inputs = [x.nan_to_num(0.0) for x in (q, k, v)]
        clean = interpreter.tree_attention(*clean_inputs, mask, prefix, 16**-0.5, num_splits=num_splits)
        out = interpreter.tree_attention(q, k, v, mask, prefix, 16**-0.5, num_splits=num_splits)
        ref = sk.reference.tree_attention(q, k, v, mask, prefix, 16**-0.5)
        assert torch.equal(out.isnan(), want) and torch.equal(ref.isnan(), want), name
        unaffected = ~want.flatten(2).any(-1)
        torch.testing.assert_close(out[unaffected], clean[unaffected], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("num_splits", (1, 3))
def test_query_with_every_score_minus_inf_is_nan(interpreter, gen, num_splits):
    """A query whose every visible score is -inf gets NaN (the reference's softmax over
    nothing), with one split as with several (one split used to write 0)."""
    q, k, v, parents, prefix = make_case(gen, batch=2, num_nodes=5, q_heads=4, kv_heads=2, head_dim=16,
                                         kind="random", ragged=False, prefix=torch.tensor([0, 7]))
    mask = tree_mask(parents)
    k[0, :5, 1, 0] = float("-inf")  # row 0 has no prefix: KV head 1's queries see only these keys ...
    q[0, :, 2:4, 0] = 1.0  # ... with q[..., 0] > 0 (heads 2, 3 share KV head 1): every score -inf
    out = interpreter.tree_attention(q, k, v, mask, prefix, 16**-0.5, num_splits=num_splits)
    ref = sk.reference.tree_attention(q, k, v, mask, prefix, 16**-0.5)
    assert ref[0, :, 2:4].isnan().all()
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out[~ref.isnan()], ref[~ref.isnan()])


def test_head_dim_too_large(interpreter):
    q = torch.randn(1, 2, 2, 320)
    k = torch.randn(1, 4, 1, 320)
    with pytest.raises(ValueError, match="^q:.*256"):
        tree_attention(q, k, k, tree_mask(torch.tensor([-1, 0])), torch.tensor([1], dtype=torch.int32), backend="triton")


@pytest.fixture
def kernel_module(request):
    """The kernel module: compiled on a CUDA machine, interpreted otherwise."""
    if HAS_CUDA:
        return importlib.import_module(KERNEL_MODULE)
    return request.getfixturevalue("interpreter")


def test_split_heuristic(kernel_module):
    choose = kernel_module.choose_num_splits  # (B, Hkv, row blocks, rows, S, SMs)
    assert choose(1, 8, 1, 4, 32768, 132) == 33  # decode, one row: fill the GPU twice
    assert choose(32, 8, 1, 4, 32768, 132) == 2
    assert choose(64, 8, 1, 4, 32768, 132) == 1  # enough programs already
    assert choose(1, 8, 1, 4, 100, 132) == 1  # short cache: one split
    assert choose(1, 8, 8, 512, 4096, 132) == 2  # big tree: fp32 partials would cost more than they save
    for args in ((1, 1, 1, 1, 10**6, 132), (1, 1, 1, 1, 300, 10**4)):
        assert 1 <= choose(*args) <= 64


# ----------------------------------------------------------------------------- GPU code generation, no GPU needed


def test_kernels_compile_for_sm80_and_sm90():
    """Every configuration the wrapper launches lowers to sm_80 / sm_90 cubins within shared memory.

    In a subprocess without TRITON_INTERPRET: triton's own helpers are interpreted in a process
    that imported it with the variable set, and cannot be compiled there.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-m", "specdec_kernels.ops.triton.compile_check"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0, "\n".join(lines) + result.stderr[-3000:]
    assert len(lines) >= 10


# ----------------------------------------------------------------------------- dispatch


def test_dispatch_triton_on_cpu_needs_interpreter(gen, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, parents, prefix = make_case(gen, batch=1, num_nodes=3, q_heads=2, kv_heads=1, head_dim=16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        tree_attention(q, k, v, tree_mask(parents), prefix, backend="triton")


def test_available_backends_triton():
    assert "triton" not in sk.available_backends("tree_attention", "cpu")
    cuda = sk.available_backends("tree_attention", "cuda")
    compiled = ["cuda"] if "CUDA" in _extension.COMPILED["tree_attention"] else []
    # The default path prefers Triton over the reference unless config.triton_by_default is off.
    if sk.config.triton_by_default:
        assert cuda == compiled + ["triton", "reference"]
    else:
        assert cuda == compiled + ["reference", "triton"]
    for op in set(_extension.OPS) - _extension.TRITON_OPS:
        assert "triton" not in sk.available_backends(op, "cuda")


def test_package_works_without_triton():
    """With triton unavailable the package imports, says so truthfully, and refuses the backend clearly."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # as if not installed
        import torch
        import specdec_kernels as sk
        from specdec_kernels.ops import _extension
        assert not _extension.HAS_TRITON
        assert "triton" not in sk.available_backends("tree_attention", "cuda")
        q = torch.randn(1, 2, 2, 16)
        k = torch.randn(1, 5, 1, 16)
        mask, prefix = sk.tree_mask(torch.tensor([-1, 0])), torch.tensor([3], dtype=torch.int32)
        sk.tree_attention(q, k, k, mask, prefix)
        try:
            sk.tree_attention(q, k, k, mask, prefix, backend="triton")
        except RuntimeError as e:
            assert "pip install triton" in str(e), e
        else:
            raise AssertionError("backend='triton' should fail without triton")
        print("OK")
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr


# ----------------------------------------------------------------------------- GPU


def _gpu_case(gen, batch, num_nodes, q_heads, kv_heads, head_dim, dtype, max_prefix, kind="random", hf=False):
    parents = random_parents(gen, batch, num_nodes, kind)
    prefix = randint(gen, 0, max_prefix + 1, (batch,))
    prefix[0] = max_prefix
    cache_len = max_prefix + num_nodes + 7
    shape = (batch, kv_heads, cache_len, head_dim) if hf else (batch, cache_len, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device="cuda", dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device="cuda", dtype=dtype)
    q = torch.randn(batch, num_nodes, q_heads, head_dim, generator=gen).to(device="cuda", dtype=dtype)
    if hf:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v, parents.cuda(), prefix.to(device="cuda", dtype=torch.int32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize(
    "batch, num_nodes, q_heads, kv_heads, head_dim, max_prefix",
    [
        (1, 1, 32, 8, 128, 8192),  # plain decode, long prefix: many splits
        (4, 16, 32, 8, 128, 2048),  # Llama-3-8B-like
        (8, 64, 28, 4, 128, 1000),  # Qwen-like GQA 7
        (2, 128, 32, 8, 128, 4096),  # big tree: several row blocks
        (3, 70, 16, 16, 64, 300),  # MHA, D=64, two mask words
        (2, 9, 8, 1, 256, 1500),  # D=256
    ],
)
def test_gpu_matches_reference(gen, dtype, batch, num_nodes, q_heads, kv_heads, head_dim, max_prefix):
    module = importlib.import_module(KERNEL_MODULE)
    assert not module.interpreted()
    for hf, packed in ((False, False), (True, True)):
        q, k, v, parents, prefix = _gpu_case(gen, batch, num_nodes, q_heads, kv_heads, head_dim, dtype, max_prefix, hf=hf)
        mask = tree_mask(parents)
        if packed:
            mask = pack_tree_mask(mask)
        ref = tree_attention(q, k, v, mask, prefix, backend="reference")
        out = tree_attention(q, k, v, mask, prefix, backend="triton")
        assert out.dtype == dtype and out.is_contiguous()
        torch.testing.assert_close(out, ref, **TOL_VS_REFERENCE[dtype])
        for splits in (1, 7):
            forced = module.tree_attention(q, k, v, mask, prefix, head_dim**-0.5, num_splits=splits)
            torch.testing.assert_close(forced, ref, **TOL_VS_REFERENCE[dtype])


@pytest.mark.gpu
@requires_cuda
def test_gpu_default_dispatch_and_cuda_graph(gen):
    """backend=None on CUDA (whichever kernel dispatch picks) matches the reference and captures in a graph."""
    q, k, v, parents, prefix = _gpu_case(gen, 2, 8, 32, 8, 128, torch.bfloat16, 1024)
    mask = pack_tree_mask(tree_mask(parents))
    ref = tree_attention(q, k, v, mask, prefix, backend="reference")
    out = tree_attention(q, k, v, mask, prefix)
    torch.testing.assert_close(out, ref, **TOL_VS_REFERENCE[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    old = sk.config.check_values
    sk.config.check_values = False  # the value checks sync with the host
    try:
        with torch.cuda.graph(graph):
            captured = tree_attention(q, k, v, mask, prefix)
    finally:
        sk.config.check_values = old
    prefix.copy_(torch.tensor([1000, 3], dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(captured, tree_attention(q, k, v, mask, prefix, backend="reference"),
                               **TOL_VS_REFERENCE[torch.bfloat16])


@pytest.mark.skipif(INTERPRETED is not None or os.environ.get("SPECDEC_TRITON_CHILD") == "1",
                    reason="the interpreter tests ran in this process")
def test_interpreter_tests_in_a_fresh_process():
    """Where they could not run here (a GPU, or triton imported first), run them in a fresh CPU-only process."""
    run_in_fresh_cpu_process(__file__, "-k", "not compile")


@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("window, softcap, value_dim", [(3, None, None), (None, 0.5, None), (None, None, 24),
                                                        (20, 30.0, 32), (1, None, 16)])
def test_window_softcap_value_dim(interpreter, gen, num_splits, window, softcap, value_dim):
    """Sliding window (shorter than the tree's depth and than the prefix), soft-capping and a
    value head dim of its own, split or not, packed and bool masks, against the brute force."""
    from test_tree_attention import with_value_dim

    prefix = torch.tensor([70, 0, 5])
    q, k, v, parents, prefix = make_case(gen, batch=3, num_nodes=9, q_heads=4, kv_heads=2, head_dim=32, prefix=prefix,
                                         kind="random")
    if value_dim is not None:
        v = with_value_dim(gen, v, value_dim, prefix, 9)
    expected = brute_attention(q, k, v, parents, prefix, window=window, softcap=softcap)
    mask = tree_mask(parents)
    for form in (mask, pack_tree_mask(mask)):
        out = interpreter.tree_attention(q, k, v, form, prefix, 32**-0.5, window or 0, softcap or 0.0,
                                         num_splits=num_splits)
        assert out.shape == q.shape[:3] + v.shape[3:] and out.is_contiguous()
        torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
    out = tree_attention(q, k, v, mask, prefix, window=window, softcap=softcap, backend="triton")
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
