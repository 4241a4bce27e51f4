"""Learned draft heads (EAGLE, Medusa) on tiny random Llama targets (CPU, seconds).

Training lowers the loss; heads round-trip through disk and refuse another target; every
head drafter gives HF greedy output token for token (batch 1 and 4, left padding) and
samples the target's exact distribution (chi-square, as test_generate). The shipped head
for the default model is only loaded, never retrained.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")
pytest.importorskip("safetensors")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop import hf  # noqa: E402
from specdec_kernels.heads import EagleDrafter, HeadNgramDrafter, MedusaDrafter, default_drafter, train_draft_head  # noqa: E402
from specdec_kernels.heads.common import read_head, target_identity  # noqa: E402
from conftest import WordTokenizer  # noqa: E402
from test_generate import (  # noqa: E402
    SAMPLE_PROMPT, SAMPLE_ROWS, SMALL_VOCAB, VOCAB, chi_square_pvalue, exact_pair_distribution, free_planner, hf_greedy,
    left_pad, repetitive_prompts, tiny_model,
)
# Shared fixtures (pytest uses fixtures found in the module's namespace): one intra-op thread
# for the module (autouse there), and the tiny target model.
from test_generate import one_thread, target  # noqa: E402,F401


def random_prompts(count: int, vocab: int, seed: int, length=(6, 20)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(length[0], length[1], (), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def train(target, tmp_path, kind, vocab, steps=4, name=None, **kw):
    out = tmp_path / (name or kind)
    args = dict(kind=kind, out_dir=out, steps=steps, max_new_tokens=12, batch_tokens=256, checkpoint_every=2, log_every=1,
                eval_fraction=0.0, progress=False, seed=0, draft_vocab_size=vocab)
    args.update(kw)
    return train_draft_head(target, random_prompts(12, vocab, seed=1), **args)


def log_rows(folder):
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """EAGLE heads (on the LM head's input; EAGLE-3 style on hidden states 0 and 1) and a
    Medusa head for `target`, trained a few steps (shared by the tests)."""
    tmp = tmp_path_factory.mktemp("heads")
    return {"eagle": train(target, tmp, "eagle", VOCAB), "medusa": train(target, tmp, "medusa", VOCAB),
            "eagle3": train(target, tmp, "eagle", VOCAB, name="eagle3", feature_layers=[0, 1])}


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_training_lowers_the_loss(tmp_path, kind):
    """KL to the target (the part of the soft cross-entropy a head can remove) falls."""
    target = tiny_model(3, logit_scale=6.0)  # peaked distributions: something to learn
    layers = dict(feature_layers=[0, 1], kind="eagle") if kind == "eagle3" else dict(kind=kind)
    out = train(target, tmp_path, name=kind, vocab=VOCAB, steps=30, lr=3e-3, batch_tokens=512, **layers)
    rows = [r for r in log_rows(out) if "loss" in r]
    assert len(rows) == 30
    key = "kl1" if kind == "medusa" else "kl"
    first, last = sum(r[key] for r in rows[:3]) / 3, sum(r[key] for r in rows[-3:]) / 3
    assert last < 0.8 * first, (first, last)


def test_collect_cache_reuses_responses(target, tmp_path):
    """A collection with more prompts answers only the new ones (cached by token ids); the
    same prompts give the same examples; other settings are refused."""
    from specdec_kernels.heads.data import collect

    prompts = random_prompts(4, VOCAB, seed=3)
    a = collect(target, prompts, max_new_tokens=5, batch_size=2, work_dir=tmp_path, progress=False)
    shards = len(list(tmp_path.glob("responses_*.pt")))
    b = collect(target, prompts + random_prompts(2, VOCAB, seed=4), max_new_tokens=5, batch_size=2, work_dir=tmp_path,
                progress=False)
    assert shards == 2 and len(list(tmp_path.glob("responses_*.pt"))) == shards + 1 and len(b) == 6
    for x, y in zip(a, b):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["features"], y["features"])
        assert x["features"].shape[0] == x["tokens"].numel() - 1 == x["lse"].numel() == x["argmax"].numel()
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        collect(target, prompts, max_new_tokens=6, work_dir=tmp_path, progress=False)
    # EAGLE-3 layers: the target's hidden states, cached in their own shards (responses and
    # features reused), one cache serving several layer sets.
    features = len(list(tmp_path.glob("features_*.pt")))
    for layers in ([1], [0, 2]):
        c = collect(target, prompts, max_new_tokens=5, batch_size=2, work_dir=tmp_path, progress=False,
                    feature_layers=layers)
        for x, y in zip(a, c):
            assert torch.equal(x["features"], y["features"]) and y["inputs"].dtype == torch.bfloat16
            with torch.no_grad():
                states = target(x["tokens"][None, :-1].long(), output_hidden_states=True).hidden_states
            torch.testing.assert_close(y["inputs"].float(), torch.stack([states[i][0] for i in layers], 1),
                                       rtol=1e-2, atol=1e-2)
    assert len(list(tmp_path.glob("features_*.pt"))) == features
    assert len(list(tmp_path.glob("layers-1_*.pt"))) >= 1 and len(list(tmp_path.glob("layers-0-2_*.pt"))) >= 1


def test_collect_responses_are_the_targets_greedy_answers(target):
    """Responses are written in left-padded batches by our own loop; each is the target's
    greedy continuation of its prompt alone (HF `generate`), cut after its first eos."""
    from specdec_kernels.heads.data import collect

    prompts = random_prompts(5, VOCAB, seed=7, length=(3, 15))
    eos = int(hf_greedy(target, torch.tensor([prompts[0]]), None, 3)[0, -1])  # an eos some row reaches
    examples = collect(target, prompts, max_new_tokens=7, batch_size=3, generation_dtype=None, eos_token_id=eos,
                       progress=False)
    cut = 0
    for prompt, example in zip(prompts, examples):
        want = hf_greedy(target, torch.tensor([prompt]), None, 7, eos_token_id=eos)[0].tolist()
        if eos in want[len(prompt):]:
            want = want[: len(prompt) + want[len(prompt):].index(eos) + 1]
            cut += 1
        assert example["tokens"].tolist() == want
    assert cut >= 1


def test_collect_features_from_a_bf16_forward(target, tmp_path):
    """feature_dtype=bfloat16: the features come from a bf16 copy of the target (close to the
    target's own): recorded by the bf16 writer as it writes, or, under an fp32 writer, by a
    bf16 forward afterwards; the labels from the target's own LM head on those features, each
    source cached in its own shards beside the target's; train_draft_head records it and
    collects it anew."""
    from specdec_kernels.heads.common import lm_head_weight
    from specdec_kernels.heads.data import collect, load_examples

    prompts = random_prompts(3, VOCAB, seed=5)
    own = collect(target, prompts, max_new_tokens=5, batch_size=2, work_dir=tmp_path, progress=False)
    low = collect(target, prompts, max_new_tokens=5, batch_size=2, work_dir=tmp_path, progress=False,
                  feature_dtype=torch.bfloat16)
    assert len(list(tmp_path.glob("features_*.pt"))) >= 1
    assert len(list(tmp_path.glob("features-writer-bfloat16_*.pt"))) >= 1
    # An fp32 writer (its own answers) and a bf16 forward over them.
    passed = collect(target, prompts, max_new_tokens=5, batch_size=2, work_dir=tmp_path / "f32", progress=False,
                     generation_dtype=None, feature_dtype=torch.bfloat16)
    assert len(list((tmp_path / "f32").glob("features-bfloat16_*.pt"))) >= 1
    weight = lm_head_weight(target)
    for x, y, z in zip(own, low, passed):
        assert torch.equal(x["tokens"], y["tokens"]) and not torch.equal(x["features"], y["features"])
        torch.testing.assert_close(y["features"].float(), x["features"].float(), rtol=0.05, atol=0.05)
        if torch.equal(z["tokens"], x["tokens"]):
            torch.testing.assert_close(z["features"].float(), x["features"].float(), rtol=0.05, atol=0.05)
        for ex in (y, z):
            logits = ex["features"].float() @ weight.T
            torch.testing.assert_close(ex["lse"], logits.logsumexp(-1), rtol=1e-4, atol=1e-4)
            assert torch.equal(ex["argmax"].long(), logits.argmax(-1))
    out = train(target, tmp_path, "eagle", VOCAB, steps=1, feature_dtype=torch.bfloat16, work_dir=tmp_path / "w")
    meta = load_examples(tmp_path / "w" / "data.pt")["meta"]
    assert meta["feature_dtype"] == "bfloat16" and meta["features_from"] == "writer"
    assert json.loads((out / "config.json").read_text())["training"]["data"]["feature_dtype"] == "bfloat16"


def test_collect_features_recorded_by_the_writer(target, tmp_path):
    """Writer and features in one dtype (here the fp32 target itself): the features are the
    writer's own LM head inputs, recorded while it writes left-padded batches whose rows stop
    at an eos at different steps. They equal a teacher-forced forward of the target over each
    prompt + response, one per position but the last, in their own shards."""
    from specdec_kernels.heads.data import collect

    prompts = random_prompts(5, VOCAB, seed=7, length=(3, 15))
    eos = int(hf_greedy(target, torch.tensor([prompts[0]]), None, 3)[0, -1])
    examples = collect(target, prompts, max_new_tokens=7, batch_size=3, generation_dtype=None, eos_token_id=eos,
                       work_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("features-writer_*.pt"))) == 2 and not list(tmp_path.glob("features_*.pt"))
    lengths = set()
    for prompt, example in zip(prompts, examples):
        tokens = example["tokens"].long()
        lengths.add(tokens.numel() - len(prompt))
        with torch.no_grad():
            hidden = target.model(tokens[None, :-1]).last_hidden_state[0]
        assert example["features"].shape == hidden.shape
        torch.testing.assert_close(example["features"].float(), hidden, rtol=2e-3, atol=2e-3)
    assert len(lengths) > 1  # rows left the batch at different steps


def test_self_written_prompts_resume_extend_and_train(target, tmp_path):
    """Self-written user turns are distinct; self-written articles become summarisation
    requests in the workload's exact wording; the cache resumes them and a larger count
    extends the same sequence; train_draft_head collects one example per article."""
    from specdec_kernels.heads.data import load_examples, self_articles, self_prompts
    from specdec_kernels.workloads import Request, summarization_request

    tok, cache = WordTokenizer(VOCAB), tmp_path / "articles.json"
    turns = self_prompts(target, tok, 3, seed=0, max_tokens=8, batch_size=4, generation_dtype=None, progress=False)
    assert len(set(turns)) == 3 and all(len(t) >= 8 for t in turns)
    args = dict(seed=0, max_tokens=60, batch_size=4, generation_dtype=None, cache=cache, progress=False)
    five = self_articles(target, tok, 5, **args)
    assert len(five) == 5 and len({r.text for r in five}) == 5
    for r in five:
        assert isinstance(r, Request) and r.workload == "summarization" and r.chat
        article = r.text.split("\n\n", 1)[1]
        assert r.text == summarization_request(article).text and len(article) >= 200
    attempts = json.loads(cache.read_text())["attempts"]
    assert [r.text for r in self_articles(target, tok, 5, **args)] == [r.text for r in five]
    assert json.loads(cache.read_text())["attempts"] == attempts  # resumed: nothing written again
    seven = self_articles(target, tok, 7, **args)
    assert [r.text for r in seven[:5]] == [r.text for r in five] and len(seven) == 7

    out = train(target, tmp_path, "eagle", VOCAB, steps=2, self_article_count=3, tokenizer=tok, work_dir=tmp_path / "w")
    meta = load_examples(tmp_path / "w" / "data.pt")["meta"]
    assert meta["self_articles"] == 3 and meta["prompts"] == 12 + 3
    assert (out / "head.safetensors").is_file()


def test_unrolled_passes_match_drafted_nodes():
    """Unrolled training pass d (input: pass d - 1's prediction g_{i-1}; context: the true
    entries up to i - d and the pass outputs before it) computes what the drafter computes for
    a depth-d chain node: the head run over the true entries 0..i-d followed by d drafted
    entries, each fed the previous entry's output."""
    from specdec_kernels.heads.modules import EagleHead
    from specdec_kernels.heads.train import eagle_passes

    cfg = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
               rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=16)
    head = EagleHead(cfg)
    head.reset_parameters(torch.Generator().manual_seed(0))
    g_ = torch.Generator().manual_seed(1)
    batch, t, depths = 2, 7, 3
    feats, embeds = torch.randn(batch, t, 32, generator=g_), torch.randn(batch, t, 32, generator=g_)
    positions = torch.arange(t)[None].expand(batch, -1)
    with torch.no_grad():
        outs = eagle_passes(head, feats, embeds, positions, depths)
        torch.testing.assert_close(outs[0], head(feats, embeds, positions))
        for d in range(1, depths + 1):
            for i in range(d, t):
                seq = feats[:, : i - d + 1]
                last = head(seq, embeds[:, : i - d + 1], positions[:, : i - d + 1])[:, -1:]
                for m in range(1, d + 1):
                    seq = torch.cat([seq, last], 1)
                    last = head(seq, embeds[:, : seq.shape[1]], positions[:, : seq.shape[1]])[:, -1:]
                torch.testing.assert_close(last[:, 0], outs[d][:, i], rtol=1e-5, atol=1e-5)


def test_prompt_weight_scales_the_prompt_positions(target):
    """EAGLE training weighs positions that predict prompt tokens by prompt_weight: at 0 the
    loss ignores their labels (here: the log-normaliser of the target's distribution there),
    at 0.2 it does not; response accuracy (racc) counts response tokens only."""
    from specdec_kernels.heads.modules import EagleHead
    from specdec_kernels.heads.train import _Trainer, head_config

    g = torch.Generator().manual_seed(0)
    head = EagleHead(head_config(target, "eagle", VOCAB))
    head.reset_parameters(g)
    head.draft_vocab.copy_(torch.arange(VOCAB))
    hidden = head.config["hidden_size"]

    def example(n, prompt_len):
        return {"tokens": torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32),
                "features": torch.randn(n - 1, hidden, generator=g).half(), "lse": torch.randn(n - 1, generator=g) + 5,
                "argmax": torch.randint(0, VOCAB, (n - 1,), generator=g, dtype=torch.int32), "prompt_len": prompt_len}

    examples = [example(24, 10), example(17, 5)]
    windows = [(0, 0, 22), (1, 0, 15)]
    changed = [dict(ex, lse=torch.cat([ex["lse"][: ex["prompt_len"] - 1] + 3.0, ex["lse"][ex["prompt_len"] - 1 :]]))
               for ex in examples]
    with torch.no_grad():
        for weight, same in ((0.0, True), (0.2, False)):
            a, metrics = _Trainer("eagle", head, target, examples, 4, 1.0, 0.0, None, 1, weight).loss(windows, None)
            b, _ = _Trainer("eagle", head, target, changed, 4, 1.0, 0.0, None, 1, weight).loss(windows, None)
            assert torch.isclose(a, b, rtol=1e-6) == same, weight
    assert metrics["rn"] == (24 - 10) + (17 - 5) and metrics["rn2"] == metrics["rn"]
    assert metrics["n"] == 22 + 15


def test_training_resumes_and_is_deterministic(target, tmp_path):
    """Same seed, same head; a run stopped at step 2 and resumed to 4 equals a run straight to 4."""
    a = train(target, tmp_path, "eagle", VOCAB, steps=4, name="a")
    b = train(target, tmp_path, "eagle", VOCAB, steps=2, name="b")
    b = train(target, tmp_path, "eagle", VOCAB, steps=4, name="b")
    ta, tb = read_head(a)[1], read_head(b)[1]
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_head_files_and_round_trip(target, heads):
    config, tensors = read_head(heads["eagle"], "eagle")
    assert config["target"] == target_identity(target)
    assert all(v.dtype == torch.float16 for k, v in tensors.items() if k != "draft_vocab")
    drafter = EagleDrafter(target, heads["eagle"], dtype=torch.float32)
    for name, value in drafter.head.state_dict().items():
        stored = tensors[name]
        assert torch.equal(value.to(stored.dtype), stored), name


def test_head_refuses_another_target(heads):
    other = tiny_model(5)  # same shapes, other weights
    with pytest.raises(ValueError, match="another target.*lm_head_sha256"):
        EagleDrafter(other, heads["eagle"])
    with pytest.raises(ValueError, match="another target"):
        MedusaDrafter(other, heads["medusa"])
    with pytest.raises(ValueError, match="expected 'medusa'"):
        MedusaDrafter(other, heads["eagle"])


def test_bad_arguments(target, heads, tmp_path):
    with pytest.raises(ValueError, match="kind"):
        train_draft_head(target, [[1, 2, 3]], kind="hydra", out_dir=tmp_path / "x")  # ("mtp" is a kind now)
    with pytest.raises(ValueError, match="steps"):
        train_draft_head(target, [[1, 2, 3]], kind="eagle", out_dir=tmp_path / "x", steps=0)
    for bad, match in ((dict(unroll=-1), "unroll"), (dict(prompt_weight=1.5), "prompt_weight"),
                       (dict(feature_layers=[0, 3]), r"feature_layers \[0, 3\].*0 \.\. 2"),
                       (dict(feature_layers=[1, 1]), "distinct"), (dict(feature_layers="eagle3"), "at least 4 layers"),
                       (dict(feature_layers="eagle2"), "'eagle3' or a list"),
                       (dict(feature_layers=[1], kind="medusa"), "only EAGLE")):
        with pytest.raises(ValueError, match=match):  # before any data is collected
            train_draft_head(target, [[1, 2, 3]], out_dir=tmp_path / "y", **{"kind": "eagle", **bad})
        assert not (tmp_path / "y" / "work" / "collect").exists()
    with pytest.raises(ValueError, match="not a head directory"):
        EagleDrafter(target, tmp_path)
    with pytest.raises(ValueError, match="max_nodes"):
        EagleDrafter(target, heads["eagle"], max_nodes=0)
    with pytest.raises(ValueError, match="online: loss"):  # online=True exists now (test_online.py)
        default_drafter(target, online={"loss": "mse"})


def test_forward_return_hidden_matches_model(target):
    """hf.forward(return_hidden=True): the same logits as the model, and hidden states whose
    LM-head image is those logits (what the heads are fed)."""
    ids = torch.tensor([repetitive_prompts(1)[0].tolist()])
    with hf.use_tree_attention(target):
        cache = hf.TreeKVCache.for_model(target, 1, 64)
        logits, hidden = hf.forward(target, cache, ids, torch.arange(ids.shape[1])[None], return_hidden=True)
    expected = target(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(target.lm_head(hidden), expected, rtol=1e-4, atol=1e-4)
    # EAGLE-3 heads ask for several hidden states (transformers' numbering), stacked on dim -2.
    states = target(ids, output_hidden_states=True).hidden_states
    with hf.use_tree_attention(target):
        cache = hf.TreeKVCache.for_model(target, 1, 64)
        logits, layers = hf.forward(target, cache, ids, torch.arange(ids.shape[1])[None], return_hidden=(0, 2))
        with pytest.raises(ValueError, match=r"hidden layers \[3\]"):
            hf.forward(target, hf.TreeKVCache.for_model(target, 1, 64), ids, torch.arange(ids.shape[1])[None],
                       return_hidden=(0, 3))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert layers.shape == (1, ids.shape[1], 2, target.config.hidden_size)
    torch.testing.assert_close(layers[:, :, 0], states[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layers[:, :, 1], states[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], hidden, rtol=1e-4, atol=1e-4)  # the last one is the LM head's input


def test_eagle3_head_reads_its_layers(target, heads):
    """An EAGLE-3 head names its layers in its config, the drafter asks generate for them,
    and a drafter merged with one that reads other layers is refused."""
    config, tensors = read_head(heads["eagle3"], "eagle")
    assert config["head"]["feature_layers"] == [0, 1] and "fuse.weight" in tensors
    assert "fuse.weight" not in read_head(heads["eagle"], "eagle")[1]
    drafter = EagleDrafter(target, heads["eagle3"])
    assert drafter.hidden_layers == (0, 1) and EagleDrafter(target, heads["eagle"]).hidden_layers is None
    assert HeadNgramDrafter(drafter, sk.NgramDrafter()).hidden_layers == (0, 1)
    assert EagleDrafter(target, heads["eagle3"], online=True).hidden_layers == (0, 1, 2)  # + the labels' layer
    with pytest.raises(ValueError, match="different hidden layers"):
        sk.MergedDrafter([drafter, EagleDrafter(target, heads["eagle"])])


def start_on_prompts(drafter, target, rows: int, capacity: int = 64):
    """Starts `drafter` on `rows` repetitive prompts (right-aligned history, as generate keeps
    it) and feeds it the target's hidden states of every prompt token but the last; returns
    (history [rows, capacity], lengths [rows])."""
    ids, mask = left_pad(repetitive_prompts(rows))
    lengths = mask.sum(1)
    history = torch.zeros(rows, capacity, dtype=torch.long)
    for b in range(rows):
        history[b, : lengths[b]] = ids[b, ids.shape[1] - lengths[b] :]
    with torch.no_grad():
        hidden = target.model(history[:, : int(lengths.max()) - 1]).last_hidden_state
    drafter.start(history, lengths, capacity)
    drafter.observe(hidden)
    return history, lengths


def test_merged_head_and_ngram_budget_and_scores(target, heads, monkeypatch):
    """The budget bounds the head's nodes (its forwards cost compute), the n-gram chain comes
    whole (free), and every merged node carries the higher of its sources' scores."""
    drafter = HEAD_DRAFTERS["eagle+ngram"](target, heads)
    drafter.confident = None  # the head drafts whatever the n-gram found (checked last)
    history, lengths = start_on_prompts(drafter, target, 2)
    ngram = drafter.ngram.propose(history, lengths)
    head = drafter.head_drafter.propose(history, lengths, budget=torch.tensor([0, 4]))
    draft = drafter.propose(history, lengths, budget=torch.tensor([0, 4]))
    tree = draft.tree
    assert int(ngram.tree.num_nodes[0]) > 1 and int(head.tree.num_nodes[1]) == 5
    assert int(tree.num_nodes[0]) == int(ngram.tree.num_nodes[0])  # row 0: the n-gram chain only
    assert max(int(head.tree.num_nodes[1]), int(ngram.tree.num_nodes[1])) <= int(tree.num_nodes[1]) <= \
        int(head.tree.num_nodes[1]) + int(ngram.tree.num_nodes[1]) - 1
    for source in (head, ngram):  # each source's paths are in the tree, scored at least as high
        for b in range(2):
            for i in range(1, int(source.tree.num_nodes[b])):
                path = source.tree.path_tokens(b, i)
                node = next(j for j in range(int(tree.num_nodes[b])) if tree.path_tokens(b, j) == path)
                assert float(draft.scores[b, node]) >= float(source.scores[b, i]) - 1e-6
    real = tree.parents >= 0
    parent_scores = draft.scores.gather(1, tree.parents.clamp(min=0))
    assert (draft.scores[real] <= parent_scores[real] + 1e-6).all()  # ancestor-closed pruning stays possible
    # No row may draft: the head is not run at all.
    calls = []
    monkeypatch.setattr(drafter.head_drafter, "_propose", lambda *a, **k: calls.append(1))
    assert drafter.propose(history, lengths, budget=torch.tensor([0, 0])).tree.num_nodes.tolist() == \
        ngram.tree.num_nodes.tolist() and not calls
    monkeypatch.undo()
    # A row whose n-gram continuation is near-certain gets no head drafts.
    first = ngram.scores[:, 1]
    assert first[0] != first[1]
    sure = int(first.argmax())
    drafter.confident = float(first.max())
    both = drafter.propose(history, lengths, budget=torch.tensor([4, 4])).tree
    assert int(both.num_nodes[sure]) == int(ngram.tree.num_nodes[sure])
    assert int(both.num_nodes[1 - sure]) > int(ngram.tree.num_nodes[1 - sure])
    with pytest.raises(ValueError, match="confident"):
        HeadNgramDrafter(drafter.head_drafter, drafter.ngram, confident=0.0)


# ----------------------------------------------------------------------------- greedy identity

HEAD_DRAFTERS = {
    "eagle_chain": lambda t, h: EagleDrafter(t, h["eagle"], max_nodes=4, top_k=1, depth=4),
    "eagle_tree": lambda t, h: EagleDrafter(t, h["eagle"], max_nodes=10, top_k=3, depth=4, min_score=0.0),
    "eagle_confident": lambda t, h: EagleDrafter(t, h["eagle"], max_nodes=10, top_k=3, depth=4, min_score=0.02),
    "medusa_tree": lambda t, h: MedusaDrafter(t, h["medusa"], max_nodes=8, top_k=3),
    "eagle+ngram": lambda t, h: HeadNgramDrafter(EagleDrafter(t, h["eagle"], max_nodes=6, top_k=2, depth=3, min_score=0.0),
                                                 sk.NgramDrafter(num_tokens=3)),
    "eagle3_tree": lambda t, h: EagleDrafter(t, h["eagle3"], max_nodes=10, top_k=3, depth=4, min_score=0.0),
}


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", list(HEAD_DRAFTERS))
def test_greedy_matches_hf_generate(target, heads, kind, batch):
    ids, mask = left_pad(repetitive_prompts(batch))
    expected = hf_greedy(target, ids, mask, 24)
    out = sk.generate(target, ids, attention_mask=mask, drafter=HEAD_DRAFTERS[kind](target, heads), max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens == [24] * batch


def test_greedy_with_eos_and_one_token_prompts(target, heads):
    """Rows stop at different steps (the drafter's state follows keep_rows); a one-token
    prompt has no feature yet, so its first step drafts nothing."""
    prompts = [[5], *repetitive_prompts(3)]
    ids, mask = left_pad(prompts)
    plain = sk.generate(target, ids, attention_mask=mask, max_new_tokens=16).sequences
    eos = int(plain[1, ids.shape[1] + 3])  # a token row 1 emits early
    expected = hf_greedy(target, ids, mask, 16, eos_token_id=eos)
    for kind in HEAD_DRAFTERS:
        out = sk.generate(target, ids, attention_mask=mask, drafter=HEAD_DRAFTERS[kind](target, heads), max_new_tokens=16,
                          eos_token_id=eos)
        assert torch.equal(out.sequences, expected), kind


def test_draft_scores_and_budget(target, heads):
    """Scores are 1 at the root and non-increasing along paths; `budget` caps each row."""
    drafter = HEAD_DRAFTERS["eagle_tree"](target, heads)
    history, lengths = start_on_prompts(drafter, target, 3)
    draft = drafter.propose(history, lengths, budget=torch.tensor([0, 3, 10]))
    tree, scores = draft.tree, draft.scores
    assert tree.num_nodes.tolist() == [1, 4, 11]
    drafter.min_score = 0.02  # without a planner (no budget) the confidence cut keeps only nodes scored >= 0.02
    cut = drafter.propose(history, lengths)
    real = cut.tree.parents >= 0
    assert torch.all(cut.scores[real] >= 0.02) and int(cut.tree.num_nodes.max()) < 1 + drafter.max_nodes
    assert drafter.propose(history, lengths, budget=torch.tensor([0, 3, 10])).tree.num_nodes.tolist() == [1, 4, 11]
    assert torch.all(scores[:, 0] == 1.0)
    for b in range(3):
        for i in range(1, int(tree.num_nodes[b])):
            parent = int(tree.parents[b, i])
            assert 0 <= parent < i and scores[b, i] <= scores[b, parent] + 1e-6
            siblings = [j for j in range(1, int(tree.num_nodes[b])) if int(tree.parents[b, j]) == parent]
            assert len({int(tree.tokens[b, j]) for j in siblings}) == len(siblings)  # distinct (greedy)


def test_chain_budget_and_confidence_cut(target, heads, monkeypatch):
    """Chains (top_k 1) take `_greedy_chain`, which drafts the trees the general best-first
    selection drafts: a row keeps the first budget[b] nodes of its full chain, and without a
    planner the confidence cut keeps the prefix scored >= min_score."""
    drafter = EagleDrafter(target, heads["eagle"], max_nodes=4, depth=4, top_k=1, min_score=0.0)
    history, lengths = start_on_prompts(drafter, target, 3)
    cases = [(None, 0.0), (torch.tensor([0, 2, 10]), 0.0), (None, 0.3)]
    fast = []
    for budget, min_score in cases:
        drafter.min_score = min_score
        fast.append(drafter.propose(history.clone(), lengths, budget=budget))
    monkeypatch.setattr(EagleDrafter, "_chains_greedily", staticmethod(lambda sampling, width: False))
    for (budget, min_score), got in zip(cases, fast):
        drafter.min_score = min_score
        want = drafter.propose(history.clone(), lengths, budget=budget)  # the general selection
        assert torch.equal(got.tree.tokens, want.tree.tokens) and torch.equal(got.tree.parents, want.tree.parents)
        torch.testing.assert_close(got.scores, want.scores)
    monkeypatch.undo()
    drafter.min_score = 0.0
    full = drafter.propose(history, lengths)
    assert full.tree.num_nodes.tolist() == [5, 5, 5]
    assert torch.equal(full.tree.parents, torch.arange(-1, 4).expand(3, -1))
    assert torch.all(full.scores[:, 1:] <= full.scores[:, :-1])
    cut = drafter.propose(history, lengths, budget=torch.tensor([0, 2, 10]))
    assert cut.tree.num_nodes.tolist() == [1, 3, 5]
    for b, n in enumerate([1, 3, 5]):
        assert torch.equal(cut.tree.tokens[b, :n], full.tree.tokens[b, :n])
        assert torch.equal(cut.scores[b, :n], full.scores[b, :n])
        assert torch.all(cut.tree.parents[b, n:] == -1) and torch.all(cut.scores[b, n:] == 0)
    threshold = float(full.scores[:, 1:].median())
    drafter.min_score = threshold
    sure = drafter.propose(history, lengths)
    expected = 1 + (full.scores[:, 1:] >= threshold).sum(1)
    assert torch.equal(sure.tree.num_nodes, expected) and int(expected.min()) < 5
    for b in range(3):
        n = int(expected[b])
        assert torch.equal(sure.tree.tokens[b, :n], full.tree.tokens[b, :n])


def extend_rows(target, history, lengths, new_tokens):
    """Appends new_tokens[b] tokens to row b of `history` (its first ones again), as accepted
    tokens would be; returns the new lengths and the target's features of the longer rows."""
    lengths = lengths.clone()
    for b, n in enumerate(new_tokens):
        history[b, lengths[b] : lengths[b] + n] = history[b, :n]
        lengths[b] += n
    with torch.no_grad():
        return lengths, target.model(history[:, : int(lengths.max()) - 1]).last_hidden_state


@pytest.mark.parametrize("chunk, per_row_padding", [(512, 4), (2, 4), (512, 0), (2, 0)])
def test_fused_layer_drafts_as_the_modules(target, heads, monkeypatch, chunk, per_row_padding):
    """On a CPU an EAGLE head's layer runs as one `decoder_layer` op (`fused_block`): its
    trees equal the torch modules' over a ragged batch and two steps (the second catches up
    3, 1 and 0 new entries: a row that fed nothing re-feeds its last), scores to rounding;
    also with the prompt's catch-up in chunks of 2 entries (`CATCH_UP_CHUNK`, 512: longer
    prompts), and with every catch-up that pads a row fed row by row (`PER_ROW_PADDING` 0;
    at 4 these rows are fed together)."""
    from specdec_kernels.heads import drafters as head_drafters

    monkeypatch.setattr(head_drafters, "CATCH_UP_CHUNK", chunk)
    monkeypatch.setattr(head_drafters, "PER_ROW_PADDING", per_row_padding)
    fused, plain = (EagleDrafter(target, heads["eagle"], max_nodes=10, depth=3, top_k=3, min_score=0.0,
                                 dtype=torch.float32) for _ in range(2))
    monkeypatch.setattr(plain, "fused_block", lambda: None)
    for drafter in (fused, plain):  # a few training steps leave attention's share tiny: make it matter
        with torch.no_grad():
            drafter.head.o_proj.weight.mul_(40.0)
    history, lengths = start_on_prompts(fused, target, 3)
    start_on_prompts(plain, target, 3)
    if fused.fused_block() is None:
        pytest.skip("no compiled decoder_layer kernel")
    for step in range(2):
        a, b = fused.propose(history, lengths), plain.propose(history, lengths)
        assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents), step
        assert torch.allclose(a.scores, b.scores, atol=1e-5), step
        assert int(a.tree.num_nodes.min()) == 11  # every row drafted a full tree
        lengths, hidden = extend_rows(target, history, lengths, [3, 1, 0])
        fused.observe(hidden)
        plain.observe(hidden)


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_target_heads(tmp_path_factory):
    target = tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    tmp = tmp_path_factory.mktemp("small_heads")
    return target, {"eagle": train(target, tmp, "eagle", SMALL_VOCAB, steps=6, lr=3e-3),
                    "medusa": train(target, tmp, "medusa", SMALL_VOCAB, steps=6, lr=3e-3),
                    "eagle3": train(target, tmp, "eagle", SMALL_VOCAB, steps=6, lr=3e-3, name="eagle3",
                                    feature_layers=[1, 2])}


@pytest.mark.parametrize("kind", list(HEAD_DRAFTERS))
def test_sampling_matches_target_distribution(small_target_heads, kind):
    target, heads = small_target_heads
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    out = sk.generate(target, ids, drafter=HEAD_DRAFTERS[kind](target, heads), max_new_tokens=2, temperature=1.0, seed=1234, adaptive=False)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    assert out.stats.acceptance_per_depth[0] > 0.05  # drafts are exercised: accepted and rejected


@pytest.mark.parametrize("kind", ["eagle_tree", "medusa_tree"])
def test_sampling_with_top_k_top_p_temperature(small_target_heads, kind):
    target, heads = small_target_heads
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    args = dict(temperature=0.7, top_k=5, top_p=0.9)
    out = sk.generate(target, ids, drafter=HEAD_DRAFTERS[kind](target, heads), max_new_tokens=2, seed=99, adaptive=False, **args)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT, **args))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"


# ----------------------------------------------------------------------------- default_drafter


def test_default_drafter_finds_a_saved_head_by_identity(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    assert isinstance(default_drafter(target), sk.ScoredMergedDrafter)  # no head for it yet: n-gram + suffix cache
    folder = train(target, tmp_path / "cache" / "heads", "eagle", VOCAB, steps=2, name="tiny-eagle")
    train(tiny_model(5), tmp_path / "cache" / "heads", "eagle", VOCAB, steps=2, name="another-target")
    drafter = default_drafter(target)
    assert isinstance(drafter, HeadNgramDrafter) and drafter.needs_hidden_states
    assert drafter.head_drafter.head.draft_vocab.numel() == read_head(folder)[1]["draft_vocab"].numel()
    # One merge of the head, the n-gram drafter and the suffix cache (the cache merged while it pays).
    assert drafter.context == drafter.ngram.drafters == [drafter.ngram.drafters[0], drafter.suffix_cache]
    assert drafter.judge.required == [True, True, False]
    for batch in (1, 3):
        ids, mask = left_pad(repetitive_prompts(batch))
        drafter = default_drafter(target)
        out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20,
                          adaptive=free_planner(target, drafter))  # drafting whatever the head costs here
        assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 20))
        assert out.stats.tokens_per_step > 1.0  # repetitive prompts: the n-gram part is accepted
        assert drafter.judge.seen[2] > 0  # the suffix cache was asked, and judged
    # head=: a given head directory instead of the lookup (still checked against the target)
    other = tmp_path / "cache" / "heads" / "another-target"
    chosen = default_drafter(target, head=tmp_path / "cache" / "heads" / "tiny-eagle")
    assert isinstance(chosen, HeadNgramDrafter) and chosen.head_drafter.source == folder
    with pytest.raises(ValueError, match="another target"):
        default_drafter(target, head=other)
    with pytest.raises(ValueError, match="not a head directory"):
        default_drafter(target, head=tmp_path)


def test_shipped_heads_load_for_the_default_model():
    """The shipped heads fit the size limit, name their target, and are what default_drafter
    picks for the default model (loaded only; never retrained here)."""
    from pathlib import Path

    from specdec_kernels.heads.drafters import find_head

    shipped = sorted((Path(sk.__file__).parent / "heads" / "trained").glob("*/config.json"))
    assert shipped, "no trained head shipped"
    for cfg in shipped:
        assert (cfg.parent / "head.safetensors").stat().st_size <= 16 * 2**20
        assert json.loads(cfg.read_text())["target"]["architecture"] == "LlamaForCausalLM"
    try:
        from specdec_kernels.models import load_model

        model, _ = load_model(verbose=False)
    except (ImportError, ModuleNotFoundError, OSError) as error:
        pytest.skip(f"default model not available: {error}")
    folder = find_head(model)
    assert folder is not None and json.loads((folder / "config.json").read_text())["kind"] == "eagle"
    drafter = default_drafter(model)
    assert isinstance(drafter, HeadNgramDrafter)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356]])  # a short chat-like prefix
    out = sk.generate(model, ids, drafter=drafter, max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(model, ids, torch.ones_like(ids), 8))


def test_train_draft_cli_dtype_options():
    """`specdec train-draft` parses --generation-dtype and --feature-dtype (model: the model itself)."""
    from specdec_kernels.cli import build_parser

    args = build_parser().parse_args(["train-draft", "--out", "x"])
    assert (args.generation_dtype, args.feature_dtype) == ("bfloat16", "model")
    args = build_parser().parse_args(["train-draft", "--out", "x", "--feature-dtype", "bfloat16"])
    assert args.feature_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-draft", "--out", "x", "--feature-dtype", "float8"])


def test_head_dtype_follows_the_device(target, heads, monkeypatch):
    """Heads draft in bf16 on a GPU and on a CPU with bf16 arithmetic, else in fp32 (a bf16
    product without it is converted first, and runs slower); an explicit dtype wins."""
    from specdec_kernels.heads import drafters as head_drafters

    assert head_drafters.head_dtype("cuda") == torch.bfloat16
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(head_drafters, "native_bf16_cpu", lambda native=native: native)
        assert head_drafters.head_dtype("cpu") == want
        assert EagleDrafter(target, heads["eagle"]).dtype == want
    assert EagleDrafter(target, heads["eagle"], dtype=torch.bfloat16).dtype == torch.bfloat16
