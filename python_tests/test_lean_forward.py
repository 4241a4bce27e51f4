"""loop.hf.lean.LeanForward: the lean tree-step forward for Llama-family models on a CPU.

Its contract is bit-identity with `hf.forward` (the model's own modules): the logits, every
`return_hidden` form and what it writes into the `TreeKVCache` must be equal, not close, for
every family it takes, dense and paged caches, ragged rows with padding nodes, random trees,
with and without our `small_linear` routing. Models it must not take are refused with the
reason, and `generate` runs it where it applies (greedy output equal to HF's either way).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels import config  # noqa: E402
from specdec_kernels.loop import hf  # noqa: E402
from specdec_kernels.loop.hf.lean import LeanForward, unsupported_reason  # noqa: E402
from specdec_kernels.ops.small_linear import small_linears  # noqa: E402
from specdec_kernels.ops.tree import tree_mask  # noqa: E402

VOCAB = 97
GEOMETRY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, vocab_size=VOCAB, bos_token_id=None,
                eos_token_id=None)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_bias_rope_scaling": ("LlamaConfig", "LlamaForCausalLM",
                                dict(attention_bias=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=False, head_dim=16)),  # q/k norms
}


def build(name: str, seed: int = 0, dtype=torch.float32, **overrides):
    config_name, model_name, extra = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_name)(**{**GEOMETRY, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval().to(dtype)
    with torch.no_grad():  # biases are zero at init: make them count
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    return model


def random_tree(gen, batch: int, nodes: int):
    """parents [B, T] (row b > 0 ragged: padding nodes -1 after its real ones), depths, tokens."""
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for b in range(batch):
        real = nodes if b == 0 else int(torch.randint(1, nodes + 1, (), generator=gen))
        for i in range(1, real):
            parents[b, i] = int(torch.randint(0, i, (), generator=gen))
    depths = torch.zeros(batch, nodes, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, nodes):
            if parents[b, i] >= 0:
                depths[b, i] = depths[b, parents[b, i]] + 1
    tokens = torch.randint(0, VOCAB, (batch, nodes), generator=gen)
    tokens = torch.where((parents >= 0) | (torch.arange(nodes) == 0), tokens, torch.full_like(tokens, -1))
    return parents, depths, tokens


def one_step(model, forward, seed: int, page_size=None, return_hidden=False, logits_to_keep=0, rows=(1, 32),
             batch=3, nodes=7):
    """Prefill ragged prompts, then one tree step by `forward`: (its output, the cache's buffers)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = 37
    history = torch.randint(0, VOCAB, (batch, prompt), generator=gen)
    lengths = torch.tensor([prompt, prompt - 9, prompt - 21][:batch])
    parents, depths, tokens = random_tree(gen, batch, nodes=nodes)
    with torch.inference_mode(), hf.use_tree_attention(model), small_linears(model, rows):
        cache = hf.TreeKVCache.for_model(model, batch, 96, page_size=page_size)
        hf.prefill(model, cache, history, lengths)
        cache.set_lengths(lengths - 1)
        positions = cache.seqlens.long()[:, None] + depths
        out = forward(model, cache, tokens, positions, tree_mask(parents), logits_to_keep=logits_to_keep,
                      return_hidden=return_hidden)
        return out, [buf.clone() for buf in cache.buffers()]


def assert_identical(a, b):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
        return
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("page_size", (None, 8), ids=("dense", "paged"))
def test_bit_identical_to_the_models_own_forward(name, page_size):
    model = build(name)
    assert unsupported_reason(model) is None
    lean = LeanForward.for_model(model)
    for seed, return_hidden, keep in ((1, False, 0), (2, True, 0), (3, (0, 1, -1, 3), 0), (4, False, 2)):
        want = one_step(model, hf.forward, seed, page_size, return_hidden, keep)
        got = one_step(model, lean.forward, seed, page_size, return_hidden, keep)
        assert_identical(got[0], want[0])
        assert_identical(tuple(got[1]), tuple(want[1]))  # the same keys and values written


def test_bit_identical_with_torch_linears_and_in_bf16():
    """Without our small_linear routing (F.linear), and for a bf16 model."""
    model = build("llama")
    lean = LeanForward.for_model(model)
    assert_identical(one_step(model, lean.forward, 5, rows=(0, 0))[0], one_step(model, hf.forward, 5, rows=(0, 0))[0])
    model16 = build("qwen2", dtype=torch.bfloat16)
    lean16 = LeanForward.for_model(model16)
    assert_identical(one_step(model16, lean16.forward, 6)[0], one_step(model16, hf.forward, 6)[0])


def test_bad_hidden_layer_index_is_refused():
    model = build("llama")
    with pytest.raises(ValueError, match="hidden states 0 .. 3"):
        one_step(model, LeanForward.for_model(model).forward, 1, return_hidden=(4,))


def test_prefill_and_other_models_go_to_the_models_own_forward():
    """No tree mask (a prefill), or another model than its own: `hf.forward` runs."""
    model, other = build("llama"), build("llama", seed=1)
    lean = LeanForward.for_model(model)
    want = one_step(other, hf.forward, 7)
    assert_identical(one_step(other, lean.forward, 7)[0], want[0])
    with torch.inference_mode(), hf.use_tree_attention(model):
        ids = torch.randint(0, VOCAB, (2, 9))
        caches = [hf.TreeKVCache.for_model(model, 2, 32) for _ in range(2)]
        a = hf.forward(model, caches[0], ids, torch.arange(9).expand(2, 9))
        b = lean.forward(model, caches[1], ids, torch.arange(9).expand(2, 9))
    assert_identical(a, b)


def test_what_it_refuses_and_why(monkeypatch):
    assert "sliding" in unsupported_reason(build("mistral", sliding_window=16))
    assert "sliding" in unsupported_reason(build("qwen2", use_sliding_window=True, sliding_window=16,
                                                 max_window_layers=0))
    assert "SiLU" in unsupported_reason(build("llama", hidden_act="gelu"))
    assert "SiLU" in unsupported_reason(build("llama", mlp_bias=True))
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**GEOMETRY, head_dim=16))
    assert "model_type 'gemma'" in unsupported_reason(gemma)

    model = build("llama")
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert "hooks" in unsupported_reason(model) and LeanForward.for_model(model) is None
    handle.remove()
    assert unsupported_reason(model) is None
    model.model.layers[0].self_attn.q_proj = torch.nn.utils.parametrize.register_parametrization(
        torch.nn.Linear(64, 64), "weight", torch.nn.Identity())
    assert "torch.nn.Linear" in unsupported_reason(model)

    model = build("llama")
    model.model.layers[2].mlp.forward = lambda x: x  # what accelerate's offloading hooks do
    assert "replaced" in unsupported_reason(model)
    model = build("llama")
    with small_linears(model, (1, 32)):  # our own routing of the linears is fine
        assert unsupported_reason(model) is None

    monkeypatch.setattr(config, "lean_forward", False)
    assert "config.lean_forward" in unsupported_reason(build("llama"))


@pytest.mark.parametrize("lean_on", (True, False), ids=("lean", "models_own"))
def test_generate_runs_it_and_matches_hf(monkeypatch, lean_on):
    """`generate` takes the lean forward where it applies (and not when turned off); greedy
    output equals HF `generate` either way, with n-gram drafts (trees) at batch 2."""
    monkeypatch.setattr(config, "lean_forward", lean_on)
    calls = []
    real = LeanForward.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LeanForward, "forward", counted)
    model = build("llama", seed=3)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 4)
    out = sk.generate(model, prompt, max_new_tokens=24, drafter=sk.NgramDrafter(), adaptive=False)
    want = model.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert torch.equal(out.sequences[:, prompt.shape[1]:], want[:, prompt.shape[1]:])
    assert bool(calls) == lean_on


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fused_layers_match_the_lean_forward(name):
    """With the linears routed to small_linear, the fused `decoder_layer` steps agree with the
    op-by-op lean forward to rounding (only RMSNorm's sum of squares runs in another order),
    every `return_hidden` form and the cache writes included, and so do steps past the range
    (their products on torch's BLAS); paged caches and steps below it run op by op."""
    model = build(name)
    fused = LeanForward.for_model(model, (1, 32))
    assert fused.fused_layers is not None
    lean = LeanForward.for_model(model)
    for seed, return_hidden in ((1, False), (2, (0, 1, -1, 3))):
        got, got_cache = one_step(model, fused.forward, seed, return_hidden=return_hidden)
        want, want_cache = one_step(model, lean.forward, seed, return_hidden=return_hidden)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    assert fused.fuses(21, hf.TreeKVCache.for_model(model, 3, 8))
    assert fused.fuses(33, hf.TreeKVCache.for_model(model, 3, 8))  # past hi: its products on torch's BLAS
    assert not LeanForward.for_model(model, (4, 32)).fuses(3, hf.TreeKVCache.for_model(model, 3, 8))
    assert not fused.fuses(21, hf.TreeKVCache.for_model(model, 3, 8, page_size=4))
    # A step past hi (21 rows > 2): fused layers with BLAS products, against the lean forward
    # whose linears are all F.linear (the same products; RMSNorm's order aside).
    blas = LeanForward.for_model(model, (1, 2))
    got, got_cache = one_step(model, blas.forward, 4, rows=(1, 2))
    want, want_cache = one_step(model, lean.forward, 4, rows=(0, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    assert_identical(one_step(model, fused.forward, 3, page_size=8)[0], one_step(model, lean.forward, 3, page_size=8)[0])
    assert LeanForward.for_model(model, (0, 0)).fused_layers is None


@pytest.mark.parametrize("name,dtype", (("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16)))
def test_greedy_steps_return_the_greedy_token_of_the_logits(monkeypatch, name, dtype):
    """forward(..., greedy=True) returns `greedy_tokens` of the logits the same step computes,
    bit for bit (bf16: of the bf16 logits, ties to the lowest id), with the same hidden states
    and cache writes, fused and op by op (from `small_linear_argmax`: an int8 copy of the head,
    kept on it until its weight changes); `greedy_rows` holds only where the head's product
    runs small_linear, up to ARGMAX_MAX_ROWS[dtype] rows, and with config.argmax_head on."""
    from functools import partial

    from specdec_kernels.loop.hf.lean import ARGMAX_MAX_ROWS
    from specdec_kernels.ops.sampling import greedy_tokens

    model = build(name).to(dtype)
    most = ARGMAX_MAX_ROWS[dtype]
    fused, by_ops = LeanForward.for_model(model, (1, 32)), LeanForward.for_model(model, (1, 32))
    by_ops.fused_layers = None
    for lean in (fused, by_ops):
        assert lean.greedy_rows(1) and lean.greedy_rows(most) and not lean.greedy_rows(most + 1)
        for seed, return_hidden, batch, nodes in ((1, False, 2, 3), (2, True, 1, 7), (3, (0, 1, -1), 2, 3)):
            want, want_cache = one_step(model, lean.forward, seed, return_hidden=return_hidden, batch=batch, nodes=nodes)
            got, got_cache = one_step(model, partial(lean.forward, greedy=True), seed, return_hidden=return_hidden,
                                      batch=batch, nodes=nodes)
            if return_hidden is False:
                want, got = (want,), (got,)
            assert_identical(got[0], greedy_tokens(want[0]))
            assert_identical(got[1:], want[1:])
            assert_identical(tuple(got_cache), tuple(want_cache))
    kept = model.lm_head.__dict__["_specdec_argmax_weights"]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.5)  # a changed head: a new copy, the new argmax
    want, _ = one_step(model, fused.forward, 4, batch=2, nodes=3)
    got, _ = one_step(model, partial(fused.forward, greedy=True), 4, batch=2, nodes=3)
    assert_identical(got, greedy_tokens(want))
    assert model.lm_head.__dict__["_specdec_argmax_weights"] is not kept
    # prepare_greedy makes the copy before any step (generate calls it: the first step would
    # otherwise pay for it, and the planner would learn that as a step's cost)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    fused.prepare_greedy()
    made = model.lm_head.__dict__["_specdec_argmax_weights"]
    assert made[0][0] == model.lm_head.weight.data_ptr() and made[1] is not None
    assert fused._argmax_weights() is made[1]  # kept: the next step finds it
    with pytest.raises(ValueError, match="greedy_rows"):  # 21 rows
        one_step(model, partial(fused.forward, greedy=True), 5)
    assert not LeanForward.for_model(model, (2, 32)).greedy_rows(1)  # the head on F.linear at 1 row
    assert not LeanForward.for_model(model).greedy_rows(1)
    monkeypatch.setattr(config, "argmax_head", False)
    assert not fused.greedy_rows(1)


@pytest.mark.parametrize("argmax_head", (True, False), ids=("argmax_head", "logits"))
def test_generate_greedy_takes_the_argmax_head_and_matches_hf(monkeypatch, argmax_head):
    """Greedy `generate` takes each node's token from `small_linear_argmax` where it applies
    (plain decoding at batch 1, n-gram trees at batch 2) and not when turned off or sampling;
    output equal to HF `generate` either way."""
    import specdec_kernels.loop.generate as generate_module
    from specdec_kernels.ops import small_linear as linear

    calls = []
    real = linear.small_linear_argmax

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(config, "argmax_head", argmax_head)
    monkeypatch.setattr(linear, "small_linear_argmax", counted)
    monkeypatch.setattr(generate_module, "_small_linear_rows", lambda target, planner: (1, 64))
    model = build("llama", seed=3)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 4)
    for rows, drafter in ((prompt[:1], None), (prompt, sk.NgramDrafter())):
        out = sk.generate(model, rows, max_new_tokens=24, drafter=drafter, adaptive=False)
        want = model.generate(rows, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert torch.equal(out.sequences[:, rows.shape[1]:], want[:, rows.shape[1]:])
        assert bool(calls) == argmax_head
        calls.clear()
    sk.generate(model, prompt[:1], max_new_tokens=8, temperature=0.8, seed=1)
    assert not calls


def test_fused_layers_are_off_when_turned_off(monkeypatch):
    monkeypatch.setattr(config, "fused_layers", False)
    assert LeanForward.for_model(build("llama"), (1, 32)).fused_layers is None


@pytest.mark.parametrize("name", ("llama", "qwen2", "qwen3"))
def test_generate_with_fused_layers_matches_hf(monkeypatch, name):
    """`generate` runs the fused layers where the target's linears run small_linear (forced here
    for every row count: on a tiny model the calibration may not choose it); greedy output
    equals HF `generate`, with n-gram trees at batch 2. (bf16 targets with our linears run the
    fused layers in test_bf16.py, where every mismatch with HF must be a bf16 tie.)"""
    import specdec_kernels.loop.generate as generate_module

    calls = []
    real = torch.ops.specdec.decoder_layer

    class Counting:
        def __call__(self, *args):
            calls.append(1)
            return real(*args)

        @property
        def default(self):  # (the lean forward calls the op's overload)
            return self

    monkeypatch.setattr(generate_module, "_small_linear_rows", lambda target, planner: (1, 64))
    monkeypatch.setattr(torch.ops.specdec, "decoder_layer", Counting())
    model = build(name, seed=3)
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0)).repeat(1, 4)
    out = sk.generate(model, prompt, max_new_tokens=24, drafter=sk.NgramDrafter(), adaptive=False)
    want = model.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert torch.equal(out.sequences[:, prompt.shape[1]:], want[:, prompt.shape[1]:])
    assert calls


def prefill_with(model, prefill, lengths, return_hidden, page_size=None, rows=(1, 32)):
    """Prefill ragged prompts of `lengths` (a one-token row included) by `prefill`: (its
    output, the cache's buffers and lengths)."""
    gen = torch.Generator().manual_seed(len(lengths))
    history = torch.randint(0, VOCAB, (len(lengths), max(lengths) + 4), generator=gen)
    with torch.inference_mode(), hf.use_tree_attention(model), small_linears(model, rows):
        cache = hf.TreeKVCache.for_model(model, len(lengths), max(lengths) + 8, page_size=page_size)
        out = prefill(model, cache, history, torch.tensor(lengths), return_hidden=return_hidden)
        return out, [buf.clone() for buf in cache.buffers()], cache.seqlens.clone()


@pytest.mark.parametrize("products", ("ours", "blas"))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fused_prefill_matches_the_models_own(monkeypatch, name, products):
    """`LeanForward.prefill` (each row in equal chunks through the fused layers, every row
    however long) agrees with `hf.prefill` to rounding: the hidden states in every
    `return_hidden` form (zeros past a row's length), the keys and values it writes and the
    lengths it sets. Chunks of at most 5 tokens where our kernel won at every row count
    compared; of at most 7 (`PREFILL_BLAS_CHUNK`, lowered) where BLAS won past 5 rows, their
    products of 6-7 rows on BLAS and of 5 or fewer on ours."""
    import specdec_kernels.loop.hf.lean as lean_module

    monkeypatch.setattr(lean_module, "PREFILL_MIN_CHUNK", 5)
    monkeypatch.setattr(lean_module, "PREFILL_BLAS_CHUNK", 7)
    # (ours: our kernel won at every count compared; blas: BLAS won at 8 rows)
    monkeypatch.setattr(lean_module.linear, "LAYOUT_ROWS", (1, 2, 5) if products == "ours" else (1, 2, 5, 8))
    model = build(name)
    lean = LeanForward.for_model(model, (1, 5))
    most = 5 if products == "ours" else 7
    assert lean.prefill_chunk(hf.TreeKVCache.for_model(model, 1, 8)) == most
    lengths = [24, 1, 14, 6, 2]  # row 0's 23 tokens: 5 chunks of 5, 5, 5, 5, 3 (ours) or 4 of 6, 6, 6, 5
    chunked = []
    real = LeanForward._prefill_row
    monkeypatch.setattr(LeanForward, "_prefill_row",
                        lambda self, *args: chunked.append(args[2:4]) or real(self, *args))
    for return_hidden in (False, True, (0, 2, -1)):
        got = prefill_with(model, lean.prefill, lengths, return_hidden, rows=(1, 5))
        want = prefill_with(model, hf.prefill, lengths, return_hidden, rows=(1, 5))
        if return_hidden is False:
            assert got[0] is None and want[0] is None
        else:
            assert got[0].shape == want[0].shape == (len(lengths), max(lengths) - 1) + want[0].shape[2:]
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        for got_buf, want_buf in zip(got[1], want[1]):  # the slots each row holds (the rest is scratch)
            for b, n in enumerate(lengths):
                torch.testing.assert_close(got_buf[b, : n - 1], want_buf[b, : n - 1], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[2], want[2])
    assert chunked == [(n - 1, most) for n in lengths] * 3  # each row's tokens but its last


def test_fused_prefill_runs_only_where_it_pays(monkeypatch):
    """The chunked prefill needs our kernel measured faster than BLAS up to PREFILL_MIN_CHUNK
    rows, fused layers and a dense cache; otherwise `LeanForward.prefill` is `hf.prefill`
    (bit for bit). `generate` runs it where it applies, and its greedy output equals HF's."""
    import specdec_kernels.loop.generate as generate_module
    import specdec_kernels.loop.hf.lean as lean_module

    model = build("llama", seed=5)
    dense = hf.TreeKVCache.for_model(model, 1, 8)
    most = max(lean_module.linear.LAYOUT_ROWS)
    assert LeanForward.for_model(model, (1, most)).prefill_chunk(dense) == most  # ours won at every count
    # BLAS won past 64 rows: chunks of up to PREFILL_BLAS_CHUNK tokens, their products on BLAS
    assert LeanForward.for_model(model, (1, 64)).prefill_chunk(dense) == lean_module.PREFILL_BLAS_CHUNK
    assert LeanForward.for_model(model, (1, 63)).prefill_chunk(dense) == 0
    assert LeanForward.for_model(model, (1, 64)).prefill_chunk(hf.TreeKVCache.for_model(model, 1, 8, page_size=4)) == 0
    assert LeanForward.for_model(model, (0, 0)).prefill_chunk(dense) == 0
    for rows in ((1, 63), (0, 0)):
        got = prefill_with(model, LeanForward.for_model(model, rows).prefill, [30, 12], True, rows=rows)
        want = prefill_with(model, hf.prefill, [30, 12], True, rows=rows)
        assert_identical(got[0], want[0])
        assert_identical(tuple(got[1]), tuple(want[1]))

    monkeypatch.setattr(lean_module, "PREFILL_MIN_CHUNK", 8)
    monkeypatch.setattr(lean_module.linear, "LAYOUT_ROWS", (1, 8))  # chunks of 8 rows at most
    monkeypatch.setattr(generate_module, "_small_linear_rows", lambda target, planner: (1, 8))
    calls = []
    real = LeanForward._prefill_row

    def counted(self, *args):
        calls.append(args[2])
        return real(self, *args)

    monkeypatch.setattr(LeanForward, "_prefill_row", counted)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (2, 7), generator=gen).repeat(1, 3)
    out = sk.generate(model, prompt, max_new_tokens=20, drafter=sk.NgramDrafter(), adaptive=False)
    want = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert torch.equal(out.sequences[:, prompt.shape[1]:], want[:, prompt.shape[1]:])
    assert calls == [20, 20]  # each row's 21 tokens but the last, in three chunks of 7
