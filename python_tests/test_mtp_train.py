"""`train_draft_head(kind="mtp")` for targets of several families: the MTP block is a decoder
layer of the target's own class, so Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral and
Gemma-2-shaped targets (zero-centred norms, extra norms around the MLP, soft-capped attention)
all train; a few steps each, then `MtpDrafter` loads the written head and

- its first draft equals the trained module's own forward (the weights made it to the drafter
  under the names the loader reads, and it runs the same network);
- its depth-2 draft equals the module's unrolled training pass (`train.mtp_passes`): what the
  training-time test trains is what the drafter computes one depth further;
- greedy output is the target's (HF `generate`, a left-padded batch of 3).

Targets that cannot have one (recurrent hybrids, logits post-processed after the LM head) are
refused before any data is collected.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.heads import MtpDrafter, train_draft_head  # noqa: E402
from specdec_kernels.heads.common import read_head  # noqa: E402
from specdec_kernels.heads.drafters import head_dtype  # noqa: E402
from specdec_kernels.heads.train import build_mtp_head, mtp_passes  # noqa: E402
from test_generate import hf_greedy, left_pad, one_thread, repetitive_prompts  # noqa: E402,F401
from test_heads import random_prompts  # noqa: E402
from test_mtp import start_drafter  # noqa: E402

VOCAB = 128  # (repetitive_prompts draws ids below 128)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
              tie_word_embeddings=False)


def tiny(family: str, seed: int = 0, **extra):
    """A 2-layer random target of `family`, fp32, eval mode."""
    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **extra))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, use_sliding_window=False, **extra))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8, **extra))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=4096, **extra))
    elif family == "gemma2":
        cfg = dict(COMMON, head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=50.0, sliding_window=16,
                   final_logit_softcapping=None)
        cfg.update(extra)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**cfg))
    else:
        raise ValueError(family)
    return model.eval()


def module_of(target, out):
    """The trained `MtpHead` rebuilt from the head directory (fp32)."""
    from safetensors.torch import load_file

    config, _ = read_head(out, "mtp")
    head = build_mtp_head(target, config["head"])
    prefix = f"model.layers.{target.config.num_hidden_layers}."
    state = {}
    for key, value in load_file(str(out / "head.safetensors")).items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        own = name if name in head.state_dict() else "block." + name
        state[own] = value.float() if value.is_floating_point() else value
    head.load_state_dict(state, strict=True)
    return head.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
def test_train_mtp_head_any_family(tmp_path, family):
    target = tiny(family)
    out = train_draft_head(target, random_prompts(10, VOCAB, seed=1), kind="mtp", out_dir=tmp_path / "mtp", steps=3,
                           unroll=1, max_new_tokens=12, batch_tokens=256, checkpoint_every=3, log_every=1,
                           eval_fraction=0.0, progress=False, seed=0, draft_vocab_size=VOCAB)
    config, _ = read_head(out, "mtp")
    assert config["head"]["block_class"] == type(target.get_decoder().layers[0]).__name__
    assert config["training"]["unroll"] == 1
    head = module_of(target, out)  # strict load: every block weight was written, under the loader's names
    embed = target.get_input_embeddings()
    # a trained head drafts in bf16 where the CPU computes in it, else fp32 (as EAGLE's)
    assert MtpDrafter(target, out).dtype == head_dtype("cpu")
    # fp32 here: the drafts must equal the training module's forward to fp32 rounding.
    drafter = MtpDrafter(target, out, max_nodes=VOCAB, depth=1, top_k=VOCAB, min_score=0.0,
                         draft_vocab=torch.arange(VOCAB), dtype=torch.float32)
    prompt = [5, 17, 3, 9, 44, 2, 8]
    history, lengths = start_drafter(drafter, target, [prompt])
    draft = drafter.propose(history, lengths)
    drafter.finish()
    tokens = torch.tensor(prompt)
    weight = target.get_output_embeddings().weight
    with torch.no_grad():
        feats = target.get_decoder()(tokens[None]).last_hidden_state
        g = head(feats[:, :-1], embed(tokens[None, 1:]), torch.arange(len(prompt) - 1)[None])
        probs = (g[0, -1] @ weight.T).softmax(-1)
    got = torch.zeros(VOCAB)
    got[draft.tree.tokens[0, 1:]] = draft.scores[0, 1:]
    assert torch.allclose(got, probs, atol=1e-5)

    # Depth 2 of a greedy chain: the unrolled training pass 1 at the last position, fed the
    # drafted first token.
    chain = MtpDrafter(target, out, num_tokens=2, min_score=0.0, draft_vocab=torch.arange(VOCAB), dtype=torch.float32)
    history, lengths = start_drafter(chain, target, [prompt])
    draft = chain.propose(history, lengths)
    t1, t2 = (int(t) for t in draft.tree.tokens[0, 1:3])
    seq = torch.tensor(prompt + [t1])
    with torch.no_grad():
        run = lambda f, e, p, cache, mask: head(f, e, p, cache, mask, return_hidden=True)  # noqa: E731
        outs = mtp_passes(run, feats, embed(seq[None, 1:]), torch.arange(len(prompt))[None], unroll=1)
        p1 = (outs[0][0, -2] @ weight.T).softmax(-1)
        p2 = (outs[1][0, -1] @ weight.T).softmax(-1)
    assert t1 == int(p1.argmax()) and t2 == int(p2.argmax())
    assert torch.allclose(draft.scores[0, 2], p1[t1] * p2[t2], atol=1e-5)

    ids, mask = left_pad(repetitive_prompts(3))
    result = sk.generate(target, ids, attention_mask=mask, drafter=MtpDrafter(target, out, num_tokens=3, min_score=0.0),
                         max_new_tokens=16, adaptive=False)
    assert torch.equal(result.sequences, hf_greedy(target, ids, mask, 16))
    with pytest.raises(ValueError, match="trained for another target"):
        MtpDrafter(tiny(family, seed=1), out)


def test_mtp_training_refuses_what_cannot_have_one(tmp_path):
    """Recurrent hybrids and soft-capped logits: ValueError before any data is collected."""
    prompts = random_prompts(2, VOCAB, seed=1)
    capped = tiny("gemma2", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="post-processes its logits"):
        train_draft_head(capped, prompts, kind="mtp", out_dir=tmp_path / "a", steps=1, progress=False)
    from test_mtp import qwen3_next_config

    torch.manual_seed(0)
    hybrid = transformers.Qwen3NextForCausalLM(qwen3_next_config()).eval()
    with pytest.raises(ValueError, match="cannot train an MTP head for Qwen3NextForCausalLM"):
        train_draft_head(hybrid, prompts, kind="mtp", out_dir=tmp_path / "b", steps=1, progress=False)
    assert not (tmp_path / "a" / "work" / "data.pt").exists() and not (tmp_path / "b" / "work" / "data.pt").exists()


def test_bench_e2e_mtp_methods_and_split(tmp_path, monkeypatch):
    """`specdec bench e2e`'s MTP rows: a trained MTP head found for the target runs as ours_mtp
    and ours_default_mtp (greedy equal to HF), and the batch-1 draft / verify / accept split is
    there for every one of our rows; without an MTP source they are skipped, saying why."""
    from specdec_kernels.benchmarks import e2e
    from conftest import WordTokenizer
    from test_bench import short_requests

    target = tiny("llama")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    requests = {"code_edit": short_requests()["code_edit"]}
    kw = dict(batch_sizes=(1,), temperatures=(0.0,), max_new_tokens=6, prompts_per_workload=1, profile_kernels=False,
              progress=False)
    rows = e2e.run(target, WordTokenizer(VOCAB), requests, methods=("hf", "ours_mtp", "ours_default_mtp", "ours_mtp_fixed"),
                   **kw)
    assert all(r["skipped"] == "no MTP layers or trained MTP head for this target" for r in rows[1:])
    assert e2e.mtp_source(target) is None and not set(e2e.MTP_METHODS) & set(e2e.default_methods("cpu", target))
    train_draft_head(target, random_prompts(4, VOCAB, seed=1), kind="mtp", out_dir=tmp_path / "heads" / "mtp", steps=2,
                     max_new_tokens=4, batch_tokens=128, eval_fraction=0.0, draft_vocab_size=VOCAB, progress=False)
    assert e2e.mtp_source(target) == ("head", tmp_path / "heads" / "mtp")
    assert set(e2e.MTP_METHODS) <= set(e2e.default_methods("cpu", target))
    rows = e2e.run(target, WordTokenizer(VOCAB), requests,
                   methods=("hf", "ours_ngram", "ours_mtp", "ours_default_mtp", "ours_mtp_fixed", "ours_mtp_fixed:3/3/1"),
                   **kw)
    assert all("skipped" not in r and r.get("greedy_identical") for r in rows[1:])
    assert "ours_mtp_fixed" not in e2e.default_methods("cpu", target)
    fixed = {r["config"]["method"]: r for r in rows if r["config"]["method"].startswith("ours_mtp_fixed")}
    assert fixed["ours_mtp_fixed"]["nodes_per_step"] <= 1 < fixed["ours_mtp_fixed:3/3/1"]["nodes_per_step"] <= 3
    headers, cells = e2e.split_rows(rows)
    assert [c[2] for c in cells] == ["ours_ngram", "ours_mtp", "ours_default_mtp", "ours_mtp_fixed", "ours_mtp_fixed:3/3/1"]
    assert all(float(c[headers.index("verify ms/step")]) > 0 for c in cells)
    assert "Decoding time per step at batch 1" in e2e.markdown(rows, "# e2e")
    from specdec_kernels.heads import HeadNgramDrafter, default_drafter
    from specdec_kernels.methods import make_drafter

    assert isinstance(make_drafter("mtp", target=target, head=tmp_path / "heads" / "mtp"), MtpDrafter)
    found = default_drafter(target)  # no EAGLE / Medusa head for this target: the trained MTP head, merged
    named = default_drafter(target, head=tmp_path / "heads" / "mtp")
    for drafter in (found, named):
        assert isinstance(drafter, HeadNgramDrafter) and isinstance(drafter.head_drafter, MtpDrafter)
