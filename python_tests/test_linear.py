"""Few-row linears by our CPU kernel (`specdec_kernels.ops.small_linear`, `torch.ops.specdec.small_linear`),
the cost model's choice of it, and generate with it on: same numbers as `F.linear` to
rounding, clear errors, only plain fp32 `torch.nn.Linear` modules patched and always
restored, the choice is the first run of measured wins, and greedy output stays identical
to HF `generate`."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import cost_model as cm  # noqa: E402
from specdec_kernels.loop import hf  # noqa: E402
from specdec_kernels.ops import small_linear as linear  # noqa: E402


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Measurements (generate's cost model) go to a temporary cache, not the user's."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))


# Odd K (the k % 8 and k % 16 tails), N not a multiple of 4 (the one-row blocks), odd row
# counts (the unpaired last row), and rows past the kernel's sweet spot: 8, 16, 17, 40 and 41
# rows take the packed-panel kernel on an AVX2 CPU (one panel; 2 + 2 panels; 3 + 2; a padded
# last panel), 1-7 rows the one-row stream, 10 rows the dot-product blocks.
MATCH_SHAPES = [(1, 7), (2, 5, 33), (3, 64), (1, 4, 4, 16), (17, 576), (1, 1), (6, 1537), (8, 7), (5, 8, 19),
                (41, 65)]


def _neighbours_replaced(x2d, gen):
    """x2d with every row but the first replaced by fresh random rows."""
    other = torch.randn(x2d.shape, generator=gen, dtype=x2d.dtype)
    other[0] = x2d[0]
    return other


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_matches_f_linear(gen, bias):
    for shape in MATCH_SHAPES:
        out_features = int(torch.randint(1, 80, (), generator=gen))
        x = torch.randn(*shape, generator=gen)
        w = torch.randn(out_features, shape[-1], generator=gen)
        b = torch.randn(out_features, generator=gen) if bias else None
        got = linear.small_linear(x, w, b)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)
        # Bit for bit, a row's sums do not depend on the rows beside it at the same row count;
        # up to 7 rows the kernels (one row's included) all sum in the same order.
        rows = x.reshape(-1, shape[-1])
        assert torch.equal(linear.small_linear(_neighbours_replaced(rows, gen), w, b)[:1], got.reshape(-1, out_features)[:1])
        if rows.shape[0] <= 7:
            assert torch.equal(linear.small_linear(rows[:1], w, b), got.reshape(-1, out_features)[:1])
    empty = linear.small_linear(torch.randn(0, 8), torch.randn(5, 8))
    assert empty.shape == (0, 5)


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_small_linear_narrower_kernels_match_f_linear(isa):
    """The kernels a wider CPU skips (SPECDEC_SMALL_LINEAR_ISA lowers the choice, read once per
    process): the same shapes as above, fp32 and bf16, in a fresh process."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from specdec_kernels.ops import small_linear as linear\n"
        "gen = torch.Generator().manual_seed(1)\n"
        f"avx2 = {isa == 'avx2'}\n"
        f"for shape in {MATCH_SHAPES!r}:\n"
        "    n = int(torch.randint(1, 80, (), generator=gen))\n"
        "    x, w, b = torch.randn(*shape, generator=gen), torch.randn(n, shape[-1], generator=gen), torch.randn(n, generator=gen)\n"
        "    want = F.linear(x.double(), w.double(), b.double())\n"
        "    torch.testing.assert_close(linear.small_linear(x, w, b).double(), want, rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)\n"
        "    rows = x.reshape(-1, shape[-1])  # a row's sums do not depend on the rows beside it\n"
        "    other = torch.randn(rows.shape, generator=gen); other[0] = rows[0]\n"
        "    assert torch.equal(linear.small_linear(other, w, b)[:1], linear.small_linear(rows, w, b)[:1])\n"
        "    if rows.shape[0] <= 7 or (rows.shape[0] in (9, 10) and avx2):  # ...and every kernel but the panels sums as the 1-row ones do\n"
        "        assert torch.equal(linear.small_linear(rows[:1], w, b), linear.small_linear(rows, w, b)[:1])\n"
        "    if x.dim() == 2:  # the greedy token from one byte per weight, as the full product's\n"
        "        assert torch.equal(linear.small_linear_argmax(x, w, *linear.argmax_weights(w)), torch.argmax(linear.small_linear(x, w), -1))\n"
        "    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()\n"
        "    want = F.linear(xb.double(), wb.double(), bb.double())\n"
        "    torch.testing.assert_close(linear.small_linear(xb, wb, bb).double(), want, rtol=1e-2, atol=1e-2 * shape[-1] ** 0.5)\n"
        "    if x.dim() == 2:\n"
        "        assert torch.equal(linear.small_linear_argmax(xb, wb, *linear.argmax_weights(wb)), torch.argmax(linear.small_linear(xb, wb).float(), -1))\n"
        "print('ok')\n")
    env = dict(os.environ, SPECDEC_SMALL_LINEAR_ISA=isa)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
def test_small_linear_stream_and_blocks_agree_bit_for_bit(tmp_path):
    """SPECDEC_SMALL_LINEAR_STREAM forces the AVX-512 kernels' stream (fp32 and bf16 1-8 rows:
    one weight row at a time for 1-2 rows, blocks of 3 prefetched into L2 for 3-8, a tail of
    single rows where the outputs do not split in threes) on (1) or off (0): each output is
    summed in the same order either way, so the products are equal bit for bit (on a CPU
    without AVX-512 both runs take the same kernel and agree trivially)."""
    code = (
        "import sys, torch\n"
        "from specdec_kernels.ops import small_linear as linear\n"
        "gen = torch.Generator().manual_seed(3)\n"
        "out = []\n"
        "for rows, k, n in [(1, 576, 37), (2, 576, 64), (1, 19, 5), (2, 1537, 9), (3, 40, 8), (3, 576, 11), (4, 576, 13), (4, 1537, 7), (5, 33, 6),\n"
        "                  (6, 576, 10), (7, 1537, 11), (8, 40, 4), (8, 576, 13), (9, 576, 7)]:\n"
        "    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)\n"
        "    out += [linear.small_linear(x, w, b), linear.small_linear(x.bfloat16(), w.bfloat16(), b.bfloat16())]\n"
        "torch.save(out, sys.argv[1])\n")
    results = []
    for stream in ("0", "1"):
        path = tmp_path / f"stream{stream}.pt"
        env = dict(os.environ, SPECDEC_SMALL_LINEAR_STREAM=stream)
        run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        results.append(torch.load(path))
    assert len(results[0]) == 28 and all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
def test_small_linear_strided_inputs_and_opcheck(gen):
    x = torch.randn(8, 3, generator=gen).T  # [3, 8], not contiguous
    w = torch.randn(8, 16, generator=gen).T  # [16, 8], not contiguous
    torch.testing.assert_close(torch.ops.specdec.small_linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.specdec.small_linear, (torch.randn(3, 24), torch.randn(5, 24), torch.randn(5)))


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
def test_small_linear_rejects_bad_input():
    op = torch.ops.specdec.small_linear
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="K = 4 but weight has K = 5"):
        op(torch.randn(2, 4), torch.randn(3, 5), None)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, K\]"):
        op(torch.randn(2, 2, 4), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))


def _argmax_cases(gen, dtype):
    """(x, weight) pairs in `dtype` for small_linear_argmax: random shapes and row counts (fp32:
    1-7 rows the stream kernel, 8 and 11+ the panels, 9-10 the blocks), near ties (a duplicated
    weight row, one a float ulp away; in bf16 the logits' rounding ties many more), weights
    exactly int8 times a row scale (the bound is the summation term and x's rounding alone), x
    with an outlier (a coarse int16 rounding), a zero row, non-finite inputs, a huge input whose
    bound is useless, every weight row equal (all tokens candidates: the full product), and
    logits rising with the token id."""
    for case in range(60):
        vocab, k_dim = int(torch.randint(1, 1500, (), generator=gen)), int(torch.randint(1, 200, (), generator=gen))
        rows = [1, 2, 3, 5, 7, 8, 9, 10, 11, 16][case % 10]
        w = torch.randn(vocab, k_dim, generator=gen) * float(torch.rand((), generator=gen) * 4)
        x = torch.randn(rows, k_dim, generator=gen)
        if case % 3 == 0 and vocab > 4:
            w[vocab // 2] = w[1]
            w[3] = torch.nextafter(w[1], torch.full_like(w[1], float("inf")))
            x[0] = w[1] * 3  # row 0 peaks at the tied tokens
        if case % 4 == 0:
            w = torch.randint(-127, 128, (vocab, k_dim), generator=gen).float() * 2.0 ** -7
        if case % 6 == 0:
            x[:, 0] *= 100
        if case % 5 == 0:
            x[-1] = 0
        if case % 7 == 0:
            x[0, 0] = float("nan")
        if case % 11 == 0:
            x[-1, 0] = float("inf")
        if case % 13 == 0:
            x[0] = 1e20
        yield x.to(dtype), w.to(dtype)
    yield torch.randn(2, 8, generator=gen).to(dtype), torch.randn(1, 8, generator=gen).repeat(1500, 1).to(dtype)
    # Logits rising with the token id: every token raises the running threshold of a scan, so a
    # thread's range keeps more than the op holds (the row is rescanned against the final one).
    u = torch.randn(16, generator=gen)
    yield torch.stack([u, -u]).to(dtype), (torch.arange(12000.0)[:, None] * u[None] * 1e-3).to(dtype)
    yield torch.randn(0, 8, generator=gen).to(dtype), torch.randn(5, 8, generator=gen).to(dtype)


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_small_linear_argmax_is_the_greedy_token_of_small_linear(gen, dtype):
    """Bit for bit the token `verify`'s greedy rule reads from small_linear's logits (lowest id
    on ties, NaN never wins; bf16 logits as float32, so ties after their rounding go to the
    lowest id), whatever the row count, ties and non-finite values."""
    from specdec_kernels.ops.sampling import greedy_tokens

    for x, w in _argmax_cases(gen, dtype):
        weight_int8, row_stats = linear.argmax_weights(w)
        got = linear.small_linear_argmax(x, w, weight_int8, row_stats)
        assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
        assert torch.equal(got, greedy_tokens(linear.small_linear(x, w).float()))
    x = torch.randn(2, 3, 16, generator=gen).to(dtype)  # leading dims kept
    w = torch.randn(40, 16, generator=gen).to(dtype)
    assert torch.equal(linear.small_linear_argmax(x, w, *linear.argmax_weights(w)),
                       greedy_tokens(linear.small_linear(x, w).float()))
    torch.library.opcheck(torch.ops.specdec.small_linear_argmax, (x[0], w, *linear.argmax_weights(w)))


def _int16_rounding(x):
    """x^ as the op rounds x [rows, K] to int16 per row (csrc/include/specdec/small_linear_argmax.h)."""
    k_dim = x.shape[-1]
    limit = min(32767, (2 ** 31 - 1) // (127 * k_dim))
    scale = (x.double().abs().amax(1) / limit).float().double()
    return torch.round(x.double() / scale[:, None]).clamp(-limit, limit) * scale[:, None]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_argmax_weights_bound_the_int8_product(gen, dtype):
    """|x . w_v - x^ . w^_v| <= ||x|| e_v + ||x - x^|| n_v, with x . w_v summed in fp32 in either
    order (here: small_linear's and a float64 one) and w^_v = s_v * int8 row; a copy into `out`;
    None for non-finite weights; clear errors."""
    w = (torch.randn(300, 96, generator=gen) * 3).to(dtype)
    out = torch.empty(300, 96, dtype=torch.int8)
    weight_int8, row_stats = linear.argmax_weights(w, out=out)
    assert weight_int8 is out and row_stats.dtype == torch.float32 and row_stats.shape == (3, 300)
    scale, err, qnorm = row_stats.double()
    assert torch.equal(scale.float(), (w.float().abs().amax(1) / 127))
    w_hat = out.double() * scale[:, None]
    assert float((w_hat - w.double()).abs().max()) <= float(scale.max()) / 2 * (1 + 1e-6)  # round to nearest
    x = torch.randn(50, 96, generator=gen)
    x[:, 5] *= 40  # an outlier: x's int16 rounding counts
    x = x.to(dtype)
    x_hat = _int16_rounding(x.float())
    bound = x.double().norm(dim=1, keepdim=True) * err + (x.double() - x_hat).norm(dim=1, keepdim=True) * qnorm
    approx = x_hat @ w_hat.T
    for exact in (x.double() @ w.double().T, (x.float() @ w.float().T).double()):
        assert bool(((approx - exact).abs() <= bound).all())
    if dtype == torch.float32:
        assert bool(((approx - linear.small_linear(x, w).double()).abs() <= bound).all())
    assert float((bound / (x.double().norm(dim=1, keepdim=True) * w.double().norm(dim=1))).max()) < 2e-2  # it decides something
    w[7, 3] = float("inf")
    assert linear.argmax_weights(w) is None
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU"):
        linear.argmax_weights(w.double())
    with pytest.raises(ValueError, match="out must be"):
        linear.argmax_weights(torch.randn(4, 8), out=torch.empty(4, 8))


@pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")
def test_small_linear_argmax_rejects_bad_input():
    op = torch.ops.specdec.small_linear_argmax
    w = torch.randn(6, 4)
    wq, stats = linear.argmax_weights(w)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        op(torch.randn(2, 4, dtype=torch.float64), w, wq, stats)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        op(torch.randn(2, 4).bfloat16(), w, wq, stats)
    with pytest.raises(RuntimeError, match="K = 4 but weight has K = 5"):
        op(torch.randn(2, 4), torch.randn(6, 5), wq, stats)
    with pytest.raises(RuntimeError, match="int8 copy"):
        op(torch.randn(2, 4), w, wq.float(), stats)
    with pytest.raises(RuntimeError, match=r"row_stats must be float32 \[3, V\]"):
        op(torch.randn(2, 4), w, wq, stats[:, :5])
    with pytest.raises(RuntimeError, match="no rows"):
        op(torch.randn(2, 4), torch.randn(0, 4), torch.zeros(0, 4, dtype=torch.int8), torch.randn(3, 0))


class _Custom(torch.nn.Linear):
    """A Linear subclass (stands for quantized or sharded linears): never patched."""


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), _Custom(16, 8), torch.nn.Linear(8, 4, bias=False))


needs_kernel = pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_linear_outside_the_range_takes_strided_inputs_as_one_product(monkeypatch, gen, dtype):
    """A strided [B, T, K] slice outside the kernel's range goes to F.linear as one [B*T, K]
    product (F.linear alone would run bmm on a per-row copy of the weight), same values."""
    x = torch.randn(4, 5, 24, generator=gen).to(dtype)[:, 1:3]  # [4, 2, 24], not contiguous
    w = torch.randn(40, 24, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    shapes = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: shapes.append(tuple(x.shape)) or real(x, w, b))
    got = linear.routed_linear(x, w, b, (0, 0))
    assert shapes == [(8, 24)] and got.shape == (4, 2, 40)
    torch.testing.assert_close(got, real(x.contiguous(), w, b))


@needs_kernel
def test_small_linears_patches_plain_fp32_linears_for_the_range_and_restores(monkeypatch):
    net = _net()
    calls = []
    real = linear.small_linear
    monkeypatch.setattr(linear, "small_linear", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    for rows, expected_calls in [(1, 0), (2, 2), (5, 2), (6, 0)]:  # 2 patched Linears; rows 2..5 take our kernel
        calls.clear()
        x = torch.randn(rows, 8)
        want = net(x)
        with linear.small_linears(net, (2, 5)):
            got = net(x)
        assert len(calls) == expected_calls, rows
        torch.testing.assert_close(got, want)
    assert all("forward" not in m.__dict__ for m in net.modules())  # restored
    calls.clear()
    with linear.small_linears(net, (0, 0)):  # never: nothing patched
        net(torch.randn(2, 8))
    with linear.small_linears(net.to(torch.float64), (1, 32)):  # neither fp32 nor bf16: nothing patched
        net(torch.randn(2, 8, dtype=torch.float64))
    assert calls == []


@needs_kernel
def test_small_linears_restores_on_error():
    net = _net()
    with pytest.raises(RuntimeError, match="boom"):
        with linear.small_linears(net, (1, 32)):
            assert "forward" in net[0].__dict__ and "forward" not in net[2].__dict__
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in net.modules())


def _tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


@needs_kernel
@pytest.mark.parametrize("outcomes,expected", [
    ("WWWWWWWW", (1, 128)),
    ("WWWWWWWL", (1, 64)),  # a loss at the last count ends the run there
    ("WWLWWWWW", (1, 2)),  # a loss ends the run: later wins do not count
    ("WWTWWWWW", (1, 128)),  # a tie (within the margin) does not
    ("WWSWWWWW", (1, 128)),  # nor a small loss (up to 10%: noise at a near-tie)
    ("TTWWWTTT", (1, 16)),  # ties after the run stay with F.linear; ties before it join it
    ("SWWWWWWW", (1, 128)),  # and so does a small loss before it (1-2 rows: noise at a near-tie)
    ("LWWWLWWW", (2, 8)),  # a loss before the first win stays with F.linear
    ("TTTTTTTT", (0, 0)),
    ("LLLLLLLL", (0, 0)),
])
def test_choose_small_linear_rows_takes_the_first_run_of_wins(monkeypatch, outcomes, expected):
    """W: ours 2x faster, T: the same time, S: ours 6% slower, L: ours 20% slower (a win needs
    3%, a loss that ends the run more than 10%)."""
    ours_seconds = {"W": 0.5, "T": 1.0, "S": 1.06, "L": 1.2}
    outcome = dict(zip(linear.LAYOUT_ROWS, outcomes))
    timed = []

    def fake_time(weights, rows, ours):
        timed.append((rows, ours))
        return ours_seconds[outcome[rows]] if ours else 1.0

    monkeypatch.setattr(linear, "_time_products", fake_time)
    assert linear.choose_small_linear_rows([torch.zeros(4, 4)], repeats=2) == expected
    assert len(timed) == 2 * len(linear.LAYOUT_ROWS) * 3  # a warm-up round, then 2 rounds, both ways
    assert linear.choose_small_linear_rows([]) == (0, 0)


def test_choose_small_linear_rows_measures():
    lo, hi = linear.choose_small_linear_rows(linear.linear_weights(_net()), counts=(1, 2, 4), repeats=1)
    assert (lo, hi) == (0, 0) or 1 <= lo <= hi <= 4


def test_calibration_records_the_layout_and_the_file_keeps_it(tmp_path):
    model = _tiny_llama()
    cost = cm.calibrate(model, rows=(1, 2), max_tokens=4, repeats=1, verbose=False)
    lo, hi = cost.small_linear_rows
    assert (lo, hi) == (0, 0) or (lo in linear.LAYOUT_ROWS and hi in linear.LAYOUT_ROWS and lo <= hi)
    cost.save(tmp_path / "c.json")
    again = cm.CostModel.load(tmp_path / "c.json", cost.key)
    assert again.small_linear_rows == cost.small_linear_rows
    assert cm.CostModel({}, {1: ([1, 2], [1.0, 1.0])}, small_linear_rows=(2, 16)).to_dict()["small_linear_rows"] == [2, 16]
    for bad in [(-1, 4), (4, 2), (0, 3)]:
        with pytest.raises(ValueError, match="small_linear_rows"):
            cm.CostModel({}, {1: ([1, 2], [1.0, 1.0])}, small_linear_rows=bad)


@needs_kernel
@pytest.mark.parametrize("drafter", ["plain", "ngram"])
def test_greedy_matches_hf_with_small_linears(monkeypatch, drafter):
    """The target's linears run our kernel for every step (its cost model says so), batch
    4 with left padding: output identical to HF generate."""
    import json

    from specdec_kernels.loop import planner

    planner._LEARNED.clear()
    model = _tiny_llama()
    g = torch.Generator().manual_seed(3)
    phrase = torch.randint(1, 128, (11,), generator=g)
    prompts = [phrase.repeat(4)[:n] for n in (31, 17, 24, 9)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    cost = cm.CostModel(cm.identity(model), {1: ([1, 10_000], [1.0, 1.0])}, small_linear_rows=(1, 32))
    monkeypatch.setitem(cm._LOADED, json.dumps(cm.identity(model), sort_keys=True), cost)  # plain decoding reads it here
    rows_seen = []
    real = linear._forward
    monkeypatch.setattr(linear, "_forward", lambda module, max_rows, x: rows_seen.append(x.shape[:-1].numel())
                        or real(module, max_rows, x))
    out = sk.generate(model, ids, attention_mask=mask, max_new_tokens=24, adaptive=planner.Planner(cost),
                      drafter=sk.NgramDrafter(num_tokens=4) if drafter == "ngram" else None)
    assert torch.equal(out.sequences, expected)
    assert any(1 <= r <= 32 for r in rows_seen), "the target's linears did not run our kernel"
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_bench_linear_smoke_writes_json(tmp_path, capsys):
    import json

    from specdec_kernels import cli

    out = tmp_path / "linear.json"
    assert cli.main(["bench", "linear", "--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "linear" and result["smoke"] is True
    tokens = [r["config"]["tokens"] for r in result["rows"]]
    assert tokens[0] == 1 and tokens == sorted(tokens)
    assert all(r["ours_us"] > 0 and r["peers_us"]["F.linear"] > 0 and r["floor_us"] > 0 for r in result["rows"])
    assert "F.linear / ours" in capsys.readouterr().out
