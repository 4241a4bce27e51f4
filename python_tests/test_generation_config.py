"""generate applies HF's logits processing from the generation config and the call, exactly:
greedy output identical to `model.generate` with each setting (for every drafter kind), the
sampled distribution exact with a repetition penalty and top-p, unsupported settings refused
by name; and our loop behind `model.generate(custom_generate=...)` and the one-line helper."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.integrations import hf  # noqa: E402
from test_generate import (SAMPLE_PROMPT, SAMPLE_ROWS, SMALL_VOCAB, chi_square_pvalue, left_pad,  # noqa: E402
                           repetitive_prompts, tiny_model, warped_probs)

SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "repetition_reward": dict(repetition_penalty=0.8),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 9], [3, 4, 6]]),
    "min_new_tokens": dict(min_new_tokens=6, eos_token_id=[11, 12]),
    "min_length": dict(min_length=30, eos_token_id=11),
    "suppress_tokens": dict(suppress_tokens=[1, 2, 3]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
    "all_at_once": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[[8, 8]], min_new_tokens=3,
                        suppress_tokens=[4], eos_token_id=11),
}
DRAFTERS = {
    "plain": lambda d: None,
    "ngram_chain": lambda d: sk.NgramDrafter(num_tokens=4),
    "ngram_tree": lambda d: sk.NgramDrafter(num_tokens=3, tree_width=3),
    "model_tree": lambda d: sk.DraftModelDrafter(d, tree_widths=(2, 2)),
}


@pytest.fixture(scope="module")
def pair():
    return tiny_model(0), tiny_model(1)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_hf_with_setting(pair, setting, drafter):
    target, draft = pair
    ids, mask = left_pad(repetitive_prompts(3))
    args = SETTINGS[setting]
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, **args)
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=16, drafter=DRAFTERS[drafter](draft), **args)
    assert torch.equal(out.sequences, expected)


def test_generation_config_of_the_model_is_applied(pair):
    """Settings in target.generation_config apply without being passed (as in HF)."""
    target = tiny_model(0)
    target.generation_config.repetition_penalty = 1.6
    target.generation_config.no_repeat_ngram_size = 2
    ids, mask = left_pad(repetitive_prompts(2))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    out = sk.generate(target, ids, attention_mask=mask, max_new_tokens=12, drafter=sk.NgramDrafter(num_tokens=4))
    assert torch.equal(out.sequences, expected)
    plain = sk.generate(tiny_model(0), ids, attention_mask=mask, max_new_tokens=12)
    assert not torch.equal(plain.sequences, expected)  # the settings did change the output


@pytest.mark.parametrize("config, name", [
    (dict(forced_eos_token_id=3), "forced_eos_token_id"),
    (dict(typical_p=0.5, do_sample=True), "typical_p"),
    (dict(num_beams=2), "num_beams"),
    (dict(sequence_bias={(3,): -1.0}), "sequence_bias"),
])
def test_unsupported_settings_are_refused(pair, config, name):
    ids, mask = left_pad(repetitive_prompts(1))
    with pytest.raises(ValueError, match=name):
        sk.generate(pair[0], ids, attention_mask=mask, max_new_tokens=4, **config)


def test_unknown_keyword_is_refused(pair):
    ids, mask = left_pad(repetitive_prompts(1))
    with pytest.raises((ValueError, TypeError), match="not_a_setting"):
        sk.generate(pair[0], ids, attention_mask=mask, max_new_tokens=4, not_a_setting=3)


def test_do_sample_from_generation_config_samples():
    target = tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    ids = torch.tensor(SAMPLE_PROMPT).expand(64, -1)
    greedy = sk.generate(target, ids, max_new_tokens=2, seed=5)
    assert (greedy.sequences == greedy.sequences[:1]).all()  # no do_sample: greedy, every row alike
    target.generation_config.do_sample = True
    target.generation_config.top_k = None
    sampled = sk.generate(target, ids, max_new_tokens=2, seed=5)
    assert not (sampled.sequences == sampled.sequences[:1]).all()


def _penalised(logits, context, penalty):
    """HF's repetition penalty written out: tokens in the context are divided (> 0) or multiplied (< 0)."""
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    seen[torch.tensor(context)] = True
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


@pytest.mark.parametrize("kind", ["plain", "ngram_chain", "model_tree"])
def test_sampling_exact_with_repetition_penalty_and_top_p(kind):
    target = tiny_model(20, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    draft = tiny_model(21, vocab=SMALL_VOCAB, hidden=32, logit_scale=8.0)
    args = dict(temperature=0.9, top_p=0.8, repetition_penalty=1.7)
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    out = sk.generate(target, ids, drafter=DRAFTERS[kind](draft), max_new_tokens=2, seed=7, **args)
    prompt = list(SAMPLE_PROMPT)
    with torch.no_grad():
        first = _penalised(target(torch.tensor([prompt])).logits[0, -1].double(), prompt, 1.7)
        p1 = warped_probs(first, 0.9, None, 0.8)
        cont = torch.cat([torch.tensor(prompt).expand(SMALL_VOCAB, -1), torch.arange(SMALL_VOCAB)[:, None]], 1)
        second = target(cont).logits[:, -1].double()
        second = torch.stack([_penalised(second[t], prompt + [t], 1.7) for t in range(SMALL_VOCAB)])
        p2 = warped_probs(second, 0.9, None, 0.8)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], (p1[:, None] * p2).flatten())
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"


def test_custom_generate_directory_and_helper(pair):
    target, _ = pair
    ids, mask = left_pad(repetitive_prompts(2))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                               repetition_penalty=1.3)
    via_hf = target.generate(ids, attention_mask=mask, max_new_tokens=10, repetition_penalty=1.3,
                             custom_generate=hf.CUSTOM_GENERATE_DIR, trust_remote_code=True,
                             drafter=sk.NgramDrafter(num_tokens=4))
    helper = hf.speculative_generate(target, ids, attention_mask=mask, max_new_tokens=10, repetition_penalty=1.3)
    assert torch.equal(via_hf, expected)
    assert torch.equal(helper, expected)


def test_helper_refuses_what_it_cannot_honour(pair):
    ids, mask = left_pad(repetitive_prompts(1))
    with pytest.raises(ValueError, match="stopping_criteria"):
        hf.speculative_generate(pair[0], ids, attention_mask=mask, max_new_tokens=4,
                                stopping_criteria=[lambda *a, **k: False])
    with pytest.raises(ValueError, match="input_ids"):
        hf.speculative_generate(pair[0], max_new_tokens=4)
