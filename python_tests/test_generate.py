"""End-to-end tests of `specdec_kernels.loop.generate` on tiny random transformers models (CPU).

Greedy: token-for-token equality with HF `generate(do_sample=False)` for every drafter and
tree shape, batches with left padding, eos and max_new_tokens edges. Sampling: the joint
distribution of the first two generated tokens over many seeded rows against the target's
exact distribution (chi-square, fixed seeds). Plus the HF integration pieces: tree forward
logits against plain forwards of each node's path, and the SDPA fallback.
"""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
scipy_stats = pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import hf  # noqa: E402
from conftest import requires_cuda  # noqa: E402

VOCAB = 128


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The reference ops run many tiny kernels; intra-op threads only add spin-waiting
    (tens of times slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def own_cache_dir(tmp_path_factory):
    """generate's planner measures the target once per model and device and caches the
    measurement: keep the tests' measurements out of the user's cache."""
    import os

    old = os.environ.get("SPECDEC_CACHE_DIR")
    os.environ["SPECDEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        os.environ.pop("SPECDEC_CACHE_DIR", None)
    else:
        os.environ["SPECDEC_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def fresh_planner_memory():
    """Each test starts without what earlier tests' rows accepted (the planner's prior)."""
    from specdec_kernels.loop import planner

    planner._LEARNED.clear()
    yield


def tiny_model(seed: int, family: str = "llama", vocab: int = VOCAB, hidden: int = 64, logit_scale: float = 1.0):
    """A 2-layer random causal LM with GQA (4 query heads, 2 KV heads), fp32, eval mode."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
    model.eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(1)


def left_pad(prompts, pad=0):
    """(input_ids, attention_mask) [B, L] with left padding."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.as_tensor(p)
        mask[b, width - len(p) :] = 1
    return ids, mask


def repetitive_prompts(batch: int, seed: int = 3):
    """Prompts that repeat a random phrase (so n-gram drafts exist), different lengths."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(1, VOCAB, (11,), generator=g)
    lengths = [31, 17, 24, 9, 40, 13][:batch]
    return [phrase.repeat(4)[:n] for n in lengths]


def hf_greedy(model, ids, mask, max_new_tokens, eos_token_id=None):
    kwargs = dict(eos_token_id=eos_token_id) if eos_token_id is not None else {}
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)


DRAFTERS = {
    "plain": lambda d: None,
    "ngram_chain": lambda d: sk.NgramDrafter(min_n=1, max_n=4, num_tokens=5),
    "ngram_tree": lambda d: sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=3),
    "model_chain": lambda d: sk.DraftModelDrafter(d, num_tokens=3),
    "model_tree": lambda d: sk.DraftModelDrafter(d, tree_widths=(2, 2, 1)),
    "merged": lambda d: sk.MergedDrafter([sk.NgramDrafter(num_tokens=4), sk.DraftModelDrafter(d, tree_widths=(2, 1))]),
}


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_matches_hf_generate(target, draft, kind, batch):
    ids, mask = left_pad(repetitive_prompts(batch))
    expected = hf_greedy(target, ids, mask, 24)
    out = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS[kind](draft), max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == [24] * batch
    assert out.stats.steps >= 1 and out.stats.tokens_per_step >= 1.0
    if kind == "ngram_chain":
        # Repetitive prompts: some drafts accepted. (Drafters the planner may leave idle are
        # not asked: on these tiny models a draft model's forwards cost 2-7 of the target's,
        # and even an n-gram tree's lookup ~0.6 of one, so whether they pay is this machine's
        # call; test_planner checks their acceptance with fixed costs.)
        assert out.stats.tokens_per_step > 1.0


@pytest.mark.parametrize("kind", ["plain", "ngram_chain", "model_tree"])
def test_greedy_matches_hf_generate_qwen2(kind):
    target, draft = tiny_model(10, "qwen2"), tiny_model(11, "qwen2")
    ids, mask = left_pad(repetitive_prompts(3, seed=5))
    expected = hf_greedy(target, ids, mask, 16)
    out = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS[kind](draft), max_new_tokens=16)
    assert torch.equal(out.sequences, expected)


def test_self_drafting_accepts_everything(target):
    """The target as its own draft model: every drafted token is accepted, and the draft
    cache stays in step with the accepted tokens across steps."""
    ids, mask = left_pad(repetitive_prompts(4))
    out = sk.generate(target, ids, attention_mask=mask, drafter=sk.DraftModelDrafter(target, num_tokens=3), max_new_tokens=20,
                      adaptive=False)  # the fixed size: every step drafts 3
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 20))
    assert out.stats.steps == 5  # 4 tokens per step
    assert out.stats.acceptance_per_depth == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_eos_stops_rows_and_pads(target, draft, kind):
    """Rows stop at different steps and leave the batch (caches and drafter state follow)."""
    ids, mask = left_pad(repetitive_prompts(4))
    free = hf_greedy(target, ids, mask, 20)[:, ids.shape[1] :]
    eos = int(free[1, 6])  # row 1 stops at (or before) its 7th new token, others maybe later
    expected = hf_greedy(target, ids, mask, 20, eos_token_id=eos)
    out = sk.generate(target, ids, attention_mask=mask, drafter=DRAFTERS[kind](draft), max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens[1] <= 7
    new = out.sequences[:, ids.shape[1] :]
    for b, n in enumerate(out.stats.new_tokens):
        assert (new[b, n:] == 0).all()  # padded with the pad token after the row stopped
        assert n == new.shape[1] or int(new[b, n - 1]) == eos


def test_ngram_drafter_index_matches_rescan():
    """On CPU the chain n-gram drafter feeds an incremental NgramIndex; its drafts must equal
    a rescan of the history with ngram_propose at every step, rows growing raggedly."""
    g = torch.Generator().manual_seed(11)
    batch, capacity = 3, 200
    history = torch.randint(1, 6, (batch, capacity), generator=g)  # small alphabet: many matches
    lengths = torch.tensor([5, 1, 30])
    indexed = sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4)
    indexed.start(history, lengths, capacity)
    assert indexed.index is not None or not sk.NgramIndex.has_compiled_backend()
    for step in range(20):
        got = indexed.propose(history, lengths).tree
        drafts, lens = sk.ngram_propose(history[:, : int(lengths.max())], lengths, min_n=1, max_n=3, num_tokens=4)
        expected = sk.TokenTree.chain(history.gather(1, (lengths - 1)[:, None])[:, 0], drafts.long(), lens)
        width = got.tokens.shape[1]
        assert torch.equal(got.tokens, expected.tokens[:, :width]) and torch.equal(got.parents, expected.parents[:, :width])
        assert (expected.parents[:, width:] == -1).all()
        lengths = lengths + torch.randint(0, 5, lengths.shape, generator=g)
        if step == 10:  # row 1 finishes: the batch keeps rows 0 and 2
            keep = torch.tensor([0, 2])
            indexed.keep_rows(keep)
            history, lengths = history[keep], lengths[keep]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tree_width", [1, 3])
def test_ngram_drafter_cuda_history_matches_cpu(tree_width):
    """A history on the GPU gets the same drafts (tokens, parents, scores) as on the CPU, on
    the GPU; without a compiled CUDA n-gram kernel, chains are matched by the host index
    (not the per-row reference loop)."""
    g = torch.Generator().manual_seed(12)
    batch, capacity = 4, 300
    history = torch.randint(1, 6, (batch, capacity), generator=g)
    lengths = torch.tensor([5, 1, 30, 64])
    on_cpu = sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=tree_width)
    on_gpu = sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=tree_width)
    on_cpu.start(history, lengths, capacity)
    on_gpu.start(history.cuda(), lengths.cuda(), capacity)
    if tree_width == 1 and "cuda" not in sk.available_backends("ngram_propose", "cuda"):
        assert on_gpu.index is not None or not sk.NgramIndex.has_compiled_backend()
    for step in range(12):
        budget = None if step % 2 else torch.randint(0, 6, (history.shape[0],), generator=g)
        want = on_cpu.propose(history, lengths, budget=budget)
        got = on_gpu.propose(history.cuda(), lengths.cuda(), budget=None if budget is None else budget.cuda())
        assert got.tree.tokens.device.type == "cuda" and got.tree.parents.device.type == "cuda"
        assert torch.equal(got.tree.tokens.cpu(), want.tree.tokens) and torch.equal(got.tree.parents.cpu(), want.tree.parents)
        assert (got.scores is None) == (want.scores is None)
        if want.scores is not None:
            assert got.scores.device.type == "cuda" and torch.equal(got.scores.cpu(), want.scores)
        lengths = lengths + torch.randint(0, 5, lengths.shape, generator=g)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 7])
def test_max_new_tokens_edges(target, max_new_tokens):
    ids, mask = left_pad(repetitive_prompts(2))
    out = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=5), max_new_tokens=max_new_tokens)
    if max_new_tokens == 0:
        assert torch.equal(out.sequences, ids)
    else:
        assert torch.equal(out.sequences, hf_greedy(target, ids, mask, max_new_tokens))
    assert out.stats.new_tokens == [max_new_tokens] * 2


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a sync on a GPU; on a CPU
    nothing tells them apart, so every such call under the package's code is counted)."""

    READS = {"__int__", "__bool__", "__float__", "__index__", "item", "tolist", "numpy", "cpu", "nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.count += 1
        elif getattr(func, "__name__", None) == "__getitem__" and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            self.count += 1
        return func(*args, **(kwargs or {}))


def host_reads(fn) -> int:
    with HostReads() as reads:
        fn()
    return reads.count


@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.8, seed=3), dict(eos=True)])
def test_plain_decoding_reads_the_device_only_at_stop_checks(target, monkeypatch, every, settings):
    """Plain decoding on an accelerator checks for finished rows every few steps
    (`STOP_CHECK_EVERY`), and reads nothing back from the device in between; forced here on
    the CPU. Output as checking every step, rows finishing at different steps included; 16
    more steps cost the 16 / every more checks' reads (two each: the lengths' maximum, the
    finished rows), nothing per step."""
    ids, mask = left_pad(repetitive_prompts(3))
    kwargs = {k: v for k, v in settings.items() if k != "eos"}
    if settings.get("eos"):
        kwargs["eos_token_id"] = int(hf_greedy(target, ids, mask, 20)[1, ids.shape[1] + 6])
    expected = {n: sk.generate(target, ids, attention_mask=mask, max_new_tokens=n, **kwargs).sequences for n in (16, 32)}
    monkeypatch.setitem(sk.loop.generate.STOP_CHECK_EVERY, "cpu", every)
    reads = {}
    for n in (16, 32):
        def run():
            out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=n, **kwargs)
            assert torch.equal(out.sequences, expected[n])
        reads[n] = host_reads(run)
    if not settings.get("eos"):
        assert reads[32] - reads[16] == 2 * 16 // every


def test_stop_check_every():
    """Every few steps on an accelerator in plain decoding; every step on a CPU, with a
    drafter (it reads the rows' tokens each step anyway) or with a streamer."""
    every = sk.loop.generate.stop_check_every
    plain, cuda = sk.loop.drafters.Drafter(), torch.device("cuda")
    assert every(cuda, plain, None) == 8
    assert every(torch.device("cpu"), plain, None) == 1
    assert every(cuda, sk.NgramDrafter(), None) == 1
    assert every(cuda, plain, object()) == 1


def test_single_token_prompts(target, draft):
    ids, mask = left_pad([[5], [7, 8, 9]])
    for drafter in (None, sk.DraftModelDrafter(draft, tree_widths=(2, 1)), sk.NgramDrafter()):
        out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=6)
        assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 6))


def test_streamer_gets_prompt_then_every_new_token(target):
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    ids, _ = left_pad(repetitive_prompts(1))
    rec = Recorder()
    out = sk.generate(target, ids, drafter=sk.NgramDrafter(), max_new_tokens=15, streamer=rec)
    assert rec.ended and rec.puts[0] == ids[0].tolist()
    assert sum(rec.puts[1:], []) == out.sequences[0, ids.shape[1] :].tolist()
    assert len(rec.puts) - 1 == out.stats.steps


def test_bad_inputs(target):
    ids, mask = left_pad(repetitive_prompts(2))
    with pytest.raises(ValueError, match="attention_mask"):
        sk.generate(target, ids, attention_mask=mask.flip(1), max_new_tokens=2)  # right padding
    with pytest.raises(ValueError, match="max_new_tokens"):
        sk.generate(target, ids, attention_mask=mask, max_new_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        sk.generate(target, ids, attention_mask=mask, max_new_tokens=2, temperature=-1.0)


def test_bad_input_ids(target):
    """Token ids must be integers inside the target's vocabulary (padding positions excepted)."""
    ids, mask = left_pad(repetitive_prompts(2))
    with pytest.raises(ValueError, match="input_ids"):
        sk.generate(target, ids.float(), attention_mask=mask, max_new_tokens=2)
    for bad in (VOCAB, -1):
        wrong = ids.clone()
        wrong[0, -1] = bad
        with pytest.raises(ValueError, match="input_ids"):
            sk.generate(target, wrong, attention_mask=mask, max_new_tokens=2)
    padded = ids.clone()
    padded[1, 0] = VOCAB + 5  # under attention_mask 0: never read
    assert mask[1, 0] == 0
    out = sk.generate(target, padded, attention_mask=mask, max_new_tokens=3)
    assert torch.equal(out.sequences[:, ids.shape[1]:], hf_greedy(target, ids, mask, 3)[:, ids.shape[1]:])


def test_timing_split_only_when_asked(target):
    ids, mask = left_pad(repetitive_prompts(2))
    plain = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(), max_new_tokens=8)
    timed = sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(), max_new_tokens=8, timing=True)
    assert torch.equal(plain.sequences, timed.sequences)
    assert plain.stats.time_verify == 0.0 and plain.stats.time_total > 0
    assert timed.stats.time_verify > 0 and timed.stats.time_draft > 0
    assert timed.stats.time_draft + timed.stats.time_verify + timed.stats.time_accept <= timed.stats.time_total


# ----------------------------------------------------------------------------- sampling

SMALL_VOCAB = 8
SAMPLE_ROWS = 2000
SAMPLE_PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2, 3]


@pytest.fixture(scope="module")
def small_pair():
    """Tiny-vocabulary target and draft with sharp-ish distributions."""
    return (tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0),
            tiny_model(21, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0))


def warped_probs(logits, temperature, top_k, top_p):
    """softmax(logits / t), top-k then top-p (written independently of the package)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_k:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p is not None and top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def exact_pair_distribution(model, prompt, temperature=1.0, top_k=None, top_p=None):
    """float64 [V * V]: P(first two generated tokens) under sequential sampling."""
    prompt = torch.tensor(prompt)
    with torch.no_grad():
        p1 = warped_probs(model(prompt[None]).logits[0, -1], temperature, top_k, top_p)
        cont = torch.cat([prompt.expand(SMALL_VOCAB, -1), torch.arange(SMALL_VOCAB)[:, None]], 1)
        p2 = warped_probs(model(cont).logits[:, -1], temperature, top_k, top_p)
    return (p1[:, None] * p2).flatten()


def chi_square_pvalue(tokens, expected_probs):
    counts = torch.bincount(tokens[:, 0] * SMALL_VOCAB + tokens[:, 1], minlength=SMALL_VOCAB**2).double()
    expected = expected_probs * tokens.shape[0]
    assert counts[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
    big = expected >= 5  # cells with small expectations are pooled into one
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:
        obs, exp = torch.cat([obs, counts[~big].sum()[None]]), torch.cat([exp, expected[~big].sum()[None]])
    return scipy_stats.chisquare(obs.numpy(), exp.numpy() * float(obs.sum() / exp.sum())).pvalue


SAMPLING_DRAFTERS = {
    "plain": lambda d: None,
    "ngram_chain": lambda d: sk.NgramDrafter(num_tokens=3),
    "ngram_tree": lambda d: sk.NgramDrafter(num_tokens=3, tree_width=3),
    "model_chain": lambda d: sk.DraftModelDrafter(d, num_tokens=3),
    "model_tree": lambda d: sk.DraftModelDrafter(d, tree_widths=(2, 2)),
    "merged": lambda d: sk.MergedDrafter([sk.NgramDrafter(num_tokens=2), sk.DraftModelDrafter(d, tree_widths=(2, 1))]),
}


def planned(model):
    """The adaptive planner with a cost model where verification is free (so drafts are
    verified whatever this machine's timings): the planner's path with a fixed answer."""
    from specdec_kernels.loop import cost_model
    from specdec_kernels.loop import planner

    return planner.Planner(cost_model.CostModel(cost_model.identity(model), {1: ([1, 10_000], [1.0, 1.0])}))


def free_planner(model, drafter):
    """`planned(model)` with drafting that costs next to nothing too: the planner drafts
    whatever this machine's timings (on these tiny models a head's or a draft model's
    forwards cost more than the target's, and the measured planner would rightly not draft)."""
    from specdec_kernels.loop import cost_model
    from specdec_kernels.loop import planner

    draft_cost = cost_model.DraftCost(cost_model.draft_identity(model, drafter), {1: ([drafter.max_nodes], [1e-9])})
    return planner.Planner(cost_model.CostModel(cost_model.identity(model), {1: ([1, 10_000], [1.0, 1.0])}),
                           draft_cost=draft_cost)


@pytest.mark.parametrize("adaptive", ["fixed", "planned"])
@pytest.mark.parametrize("kind", list(SAMPLING_DRAFTERS))
def test_sampling_matches_target_distribution(small_pair, kind, adaptive):
    target, draft = small_pair
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    out = sk.generate(target, ids, drafter=SAMPLING_DRAFTERS[kind](draft), max_new_tokens=2, temperature=1.0, seed=1234,
                      adaptive=planned(target) if adaptive == "planned" else False)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    if kind != "plain":
        assert out.stats.acceptance_per_depth[0] > 0.05  # the drafts are exercised, accept and reject


@pytest.mark.parametrize("adaptive", ["fixed", "planned"])
@pytest.mark.parametrize("kind", ["plain", "model_tree", "ngram_chain"])
def test_sampling_with_top_k_top_p_temperature(small_pair, kind, adaptive):
    target, draft = small_pair
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    args = dict(temperature=0.7, top_k=5, top_p=0.9)
    out = sk.generate(target, ids, drafter=SAMPLING_DRAFTERS[kind](draft), max_new_tokens=2, seed=99,
                      adaptive=planned(target) if adaptive == "planned" else False, **args)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT, **args))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"


def test_seeds_reproducible_and_per_row(target, draft):
    ids, mask = left_pad(repetitive_prompts(3))
    run = lambda seed: sk.generate(target, ids, attention_mask=mask, drafter=sk.DraftModelDrafter(draft, num_tokens=2),  # noqa: E731
                                   max_new_tokens=12, temperature=1.0, seed=seed).sequences
    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))
    assert torch.equal(run(torch.tensor([1, 2, 3])), run(torch.tensor([1, 2, 3])))


def test_steps_use_fresh_randomness(small_pair):
    """A row's successive steps must not reuse random numbers: with plain decoding and one
    seed, the generated tokens are not a function of the position only."""
    target, _ = small_pair
    ids = torch.tensor(SAMPLE_PROMPT).expand(400, -1)
    out = sk.generate(target, ids, max_new_tokens=6, temperature=1.0, seed=5).sequences[:, -6:]
    assert len({tuple(r) for r in out.tolist()}) > 100


# ----------------------------------------------------------------------------- HF integration


def test_tree_forward_matches_plain_forward_of_each_path(target):
    """Each tree node's logits equal a plain forward of prefix + its root-to-node path."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (12, 7, 10)]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5])
    tokens = torch.randint(1, VOCAB, (3, parents.numel()), generator=g)
    tree = sk.TokenTree(tokens, parents)
    ids, mask = left_pad(prompts)
    lengths = mask.sum(1)
    history = torch.zeros(3, 40, dtype=torch.long)
    for b, p in enumerate(prompts):
        history[b, : len(p)] = p
    cache = hf.TreeKVCache.for_model(target, 3, 40)
    with torch.no_grad(), hf.use_tree_attention(target):
        hf.prefill(target, cache, history, lengths)
        tree.tokens[:, 0] = history[torch.arange(3), lengths - 1]
        positions = cache.seqlens.long()[:, None] + tree.depths
        logits = hf.forward(target, cache, tree.tokens, positions, tree.mask(packed=True))
        for b, p in enumerate(prompts):
            for i in range(parents.numel()):
                seq = torch.cat([p, torch.tensor(tree.path_tokens(b, i)[1:], dtype=torch.long)])
                ref = target(seq[None]).logits[0, -1]
                torch.testing.assert_close(logits[b, i], ref, atol=1e-4, rtol=1e-4)
    assert target.config._attn_implementation != hf.NAME  # restored


@pytest.mark.parametrize("page_size", [None, 4])
@pytest.mark.parametrize("return_hidden", [False, True, (0, -1)])
def test_prefill_of_rows_one_at_a_time_equals_the_padded_batch(target, monkeypatch, page_size, return_hidden):
    """Rows of very different lengths prefill one at a time (no padding computed): the cache
    rows and the hidden states equal the padded batch's, and the lengths are the prefixes."""
    import specdec_kernels.loop.hf.attention as hf_attention

    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([30, 4, 1, 17])  # one row with nothing to prefill
    history = torch.randint(1, VOCAB, (4, 40), generator=g)
    results = []
    for limit in (1e9, 1.0):  # always the padded batch; then rows one at a time
        monkeypatch.setattr(hf_attention, "PADDING_LIMIT", limit)
        cache = hf.TreeKVCache.for_model(target, 4, 40, page_size=page_size)
        calls = []
        row = cache.row
        monkeypatch.setattr(cache, "row", lambda b: calls.append(b) or row(b))
        with torch.no_grad(), hf.use_tree_attention(target):
            hidden = hf.prefill(target, cache, history, lengths, return_hidden=return_hidden)
        assert calls == ([] if limit > 1e8 else [0, 1, 2, 3])
        assert cache.seqlens.tolist() == [29, 3, 0, 16] and cache.max_len == 29
        results.append((cache, hidden))
    (padded, hidden_padded), (rows, hidden_rows) = results
    for layer in range(len(padded.layers)):
        for b, n in enumerate([29, 3, 0, 16]):
            for name in ("k_buf", "v_buf"):
                if page_size is None:
                    want, got = getattr(padded.layers[layer], name)[b, :n], getattr(rows.layers[layer], name)[b, :n]
                else:  # each row's slots through its block table
                    slots = torch.arange(n)
                    want, got = [getattr(c.layers[layer], name)[c.block_table[b, slots // page_size].long(),
                                                                 slots % page_size] for c in (padded, rows)]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if return_hidden is False:
        assert hidden_padded is None and hidden_rows is None
        return
    assert hidden_rows.shape == hidden_padded.shape
    for b, n in enumerate([29, 3, 0, 16]):
        torch.testing.assert_close(hidden_rows[b, :n], hidden_padded[b, :n], atol=1e-5, rtol=1e-5)
        assert not hidden_rows[b, n:].any()


def test_tree_kv_cache_writes_ragged_and_compacts():
    """update() writes at seqlens[b] + j and returns [B, H, max_len + T, D] views of the
    preallocated buffers; compact_() keeps the accepted path and grows the lengths."""
    cache = hf.TreeKVCache(num_layers=2, batch_size=2, capacity=16, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    cache.set_lengths(torch.tensor([3, 5]))
    buffers = [b.data_ptr() for b in cache.buffers()]
    keys = torch.randn(2, 2, 4, 4)  # [B, H, T=4, D]
    for layer in range(2):
        k_view, v_view = cache.update(keys + layer, -keys, layer)
        assert k_view.shape == (2, 2, 9, 4) and k_view.data_ptr() == buffers[2 * layer]
    k0 = cache.layers[0].k_buf
    torch.testing.assert_close(k0[0, 3:7], keys[0].transpose(0, 1))
    torch.testing.assert_close(k0[1, 5:9], keys[1].transpose(0, 1))
    accepted = torch.tensor([[0, 2, -1, -1], [0, 1, 3, -1]], dtype=torch.int32)
    cache.compact_(accepted, torch.tensor([1, 2], dtype=torch.int32))
    assert cache.seqlens.tolist() == [5, 8] and cache.max_len == 8
    torch.testing.assert_close(k0[0, 4], keys[0, :, 2])
    torch.testing.assert_close(k0[1, 6:8], keys[1, :, [1, 3]].transpose(0, 1))
    torch.testing.assert_close(cache.layers[1].v_buf[1, 7], -keys[1, :, 3])
    assert [b.data_ptr() for b in cache.buffers()] == buffers  # in place, no reallocation


def test_fallback_attention_is_sdpa(target):
    """Ordinary forwards under `specdec_tree` (no tree metadata) match SDPA, with padding."""
    ids, mask = left_pad(repetitive_prompts(3))
    with torch.no_grad():
        expected = target(ids, attention_mask=mask).logits
        with hf.use_tree_attention(target):
            got = target(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=1e-5)


def test_import_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import specdec_kernels as sk\n"
        "d = sk.NgramDrafter(); assert callable(sk.generate) and sk.GenerateOutput\n"
        "import torch\n"
        "try:\n"
        "    sk.generate(None, torch.ones(1, 2, dtype=torch.long), max_new_tokens=1)\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
