"""TreeLogitsProcessor against transformers' own logits processors, node by node.

For every node of random trees over random ragged batches we build the context HF would see
at that point of sequential decoding (the padded prompt, the generated tokens, the node's
path) and run HF's processor on it; our tree-wide result must match exactly (-inf included).
"""

import pytest
import torch

from conftest import random_parents
from specdec_kernels.loop.logits_processing import TreeLogitsProcessor, refused_settings, sampling_settings
from specdec_kernels.ops.tree import TokenTree

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig  # noqa: E402
from transformers.generation import logits_process as hf  # noqa: E402

VOCAB = 23
EOS = [2, 5]


def _case(gen, batch, num_nodes, prompt_len, max_generated, kind):
    """Prompts (left padded, pad id 0), a left-aligned history and a random tree per row, drawn
    from a small vocabulary so that repeats, n-grams and bad words actually occur."""
    real_len = torch.randint(1, prompt_len + 1, (batch,), generator=gen)
    mask = (torch.arange(prompt_len)[None, :] >= (prompt_len - real_len)[:, None]).long()
    prompts = torch.where(mask.bool(), torch.randint(0, 6, (batch, prompt_len), generator=gen), 0)
    generated = torch.randint(0, max_generated + 1, (batch,), generator=gen)
    lengths = real_len + generated
    history = torch.full((batch, prompt_len + max_generated + 3), -1, dtype=torch.int64)
    gen_tokens = torch.randint(0, 6, (batch, max_generated), generator=gen)
    for b in range(batch):
        history[b, : real_len[b]] = prompts[b, prompt_len - real_len[b]:]
        history[b, real_len[b] : lengths[b]] = gen_tokens[b, : generated[b]]
    parents = random_parents(gen, batch, num_nodes, kind=kind)
    tokens = torch.randint(0, 6, (batch, num_nodes), generator=gen)
    tokens[:, 0] = history.gather(1, (lengths - 1)[:, None])[:, 0]
    tokens = torch.where((parents >= 0) | (torch.arange(num_nodes) == 0), tokens, -1)
    logits = torch.randn(batch, num_nodes, VOCAB, generator=gen) * 3
    return prompts, mask, history, lengths, generated, tokens, parents, logits


def _hf_processors(config, prompt_len, pad_length):
    """HF's processors for `config`, in HF's order, for one row."""
    eos = torch.tensor(EOS)
    procs = []
    if config.get("repetition_penalty"):
        procs.append(hf.RepetitionPenaltyLogitsProcessor(config["repetition_penalty"], prompt_ignore_length=int(pad_length)))
    if config.get("no_repeat_ngram_size"):
        procs.append(hf.NoRepeatNGramLogitsProcessor(config["no_repeat_ngram_size"]))
    if config.get("bad_words_ids"):
        procs.append(hf.NoBadWordsLogitsProcessor(config["bad_words_ids"], eos_token_id=eos))
    if config.get("min_length"):
        procs.append(hf.MinLengthLogitsProcessor(config["min_length"], eos))
    if config.get("min_new_tokens"):
        procs.append(hf.MinNewTokensLengthLogitsProcessor(prompt_len, config["min_new_tokens"], eos))
    if config.get("suppress_tokens"):
        procs.append(hf.SuppressTokensLogitsProcessor(config["suppress_tokens"]))
    if config.get("begin_suppress_tokens"):
        procs.append(hf.SuppressTokensAtBeginLogitsProcessor(config["begin_suppress_tokens"], prompt_len))
    return procs


CONFIGS = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7),
    dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=3),
    dict(bad_words_ids=[[3], [1, 4], [0, 1, 2], [2]]),
    dict(min_length=9),
    dict(min_new_tokens=3),
    dict(suppress_tokens=[4, 7]),
    dict(begin_suppress_tokens=[1, 3]),
    dict(repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[1, 1]], min_new_tokens=2, suppress_tokens=[9],
         begin_suppress_tokens=[0]),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(c))
@pytest.mark.parametrize("kind", ["random", "chain", "star", "deep"])
def test_matches_hf_processors_per_node(gen, config, kind):
    batch, num_nodes, prompt_len = 4, 9, 6
    prompts, mask, history, lengths, generated, tokens, parents, logits = _case(gen, batch, num_nodes, prompt_len, 5, kind)
    processor = TreeLogitsProcessor(prompts, mask, EOS, VOCAB, **config)
    depths = TokenTree(tokens, parents).depths
    rows = torch.arange(batch)
    ours = processor(logits, tokens, parents, depths, history, lengths, generated, rows)
    for b in range(batch):
        prefix = prompts[b].tolist() + history[b, lengths[b] - generated[b] : lengths[b]].tolist()
        procs = _hf_processors(config, prompt_len, int((mask[b] == 0).sum()))
        for i in range(num_nodes):
            if i > 0 and parents[b, i] < 0:
                continue
            path, node = [], i
            while node > 0:
                path.append(int(tokens[b, node]))
                node = int(parents[b, node])
            context = torch.tensor([prefix + path[::-1]])
            expected = logits[b, i][None].clone()
            for proc in procs:
                expected = proc(context, expected)
            torch.testing.assert_close(ours[b, i], expected[0], msg=f"row {b} node {i} context {context.tolist()}")


def test_rows_select_their_prompts(gen):
    """`rows` maps the current batch to the prompts (finished rows have left the batch)."""
    prompts, mask, history, lengths, generated, tokens, parents, logits = _case(gen, 4, 5, 6, 3, "chain")
    processor = TreeLogitsProcessor(prompts, mask, EOS, VOCAB, repetition_penalty=1.5, min_length=8)
    depths = TokenTree(tokens, parents).depths
    full = processor(logits, tokens, parents, depths, history, lengths, generated, torch.arange(4))
    keep = torch.tensor([3, 1])
    part = processor(logits[keep], tokens[keep], parents[keep], depths[keep], history[keep], lengths[keep],
                     generated[keep], keep)
    torch.testing.assert_close(part, full[keep])


def test_unsupported_settings_are_named():
    config = GenerationConfig(forced_eos_token_id=3, typical_p=0.5, repetition_penalty=1.1)
    assert refused_settings(config) == ["forced_eos_token_id=3", "typical_p=0.5"]
    with pytest.raises(ValueError, match="forced_eos_token_id=3, typical_p=0.5"):
        TreeLogitsProcessor.from_generation_config(config, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), EOS, VOCAB)
    assert refused_settings(GenerationConfig()) == []


def test_no_processing_gives_none():
    assert TreeLogitsProcessor.from_generation_config(GenerationConfig(), torch.zeros(1, 2, dtype=torch.long),
                                                      torch.ones(1, 2), EOS, VOCAB) is None


@pytest.mark.parametrize("bad, match", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
    (dict(bad_words_ids=[[VOCAB]]), "bad_words_ids"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"),
    (dict(suppress_tokens=[-1]), "suppress_tokens"),
    (dict(begin_suppress_tokens=[VOCAB]), "begin_suppress_tokens"),
])
def test_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        TreeLogitsProcessor(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), EOS, VOCAB, **bad)


def test_sampling_settings_follow_hf():
    assert sampling_settings(GenerationConfig(), None, None, None) == (0.0, None, None)
    assert sampling_settings(GenerationConfig(top_k=20), None, None, None) == (0.0, None, None)
    assert sampling_settings(GenerationConfig(do_sample=True, temperature=0.6, top_k=20, top_p=0.9), None, None, None) == (0.6, 20, 0.9)
    # HF's default top_k (50) applies when sampling is on and the call leaves it unset.
    assert sampling_settings(GenerationConfig(do_sample=True), None, None, None) == (1.0, 50, None)
    assert sampling_settings(GenerationConfig(do_sample=True), None, 7, 0.5) == (1.0, 7, 0.5)
    # An explicit temperature keeps its meaning; the config's own top_k / top_p fill in, HF's
    # global defaults do not; explicit top_k / top_p win.
    assert sampling_settings(GenerationConfig(do_sample=True, top_k=20), 0.0, None, None) == (0.0, None, None)
    assert sampling_settings(GenerationConfig(do_sample=True, top_k=20), 0.7, None, None) == (0.7, 20, None)
    assert sampling_settings(GenerationConfig(), 0.7, None, None) == (0.7, None, None)
    assert sampling_settings(GenerationConfig(do_sample=True, top_k=20), 0.7, 5, None) == (0.7, 5, None)
