"""Every decoder family transformers ships that we claim, on a tiny random config (CPU).

For each family in FAMILIES: greedy `generate` with n-gram drafts (a tree) and with a draft
model (the target itself, so whole drafts are accepted and compacted), batch 2 with left
padding, equals HF `generate(do_sample=False)` token for token (EOS off on both sides), with
a dense and with a paged cache; families the loop cannot run are refused at the start with
NotImplementedError naming the family. Sampled rows are checked by chi-square on Gemma 2
and DeepSeek-V3. Windows are small (4 tokens) so the context really exceeds them.

`tools/model_table.py` turns FAMILIES into the supported-families table in docs/models.md
(test_table_is_current keeps the two in step).
"""

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.loop.hf import families  # noqa: E402
from test_generate import (SAMPLE_PROMPT, SAMPLE_ROWS, SMALL_VOCAB, chi_square_pvalue,  # noqa: E402,F401
                           exact_pair_distribution, fresh_planner_memory, left_pad, one_thread, own_cache_dir,
                           repetitive_prompts)

VOCAB = 128
WINDOW = 4  # sliding windows: far shorter than the prompts (9 .. 31 tokens)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The usual decoder geometry (most configs take these names); families override below.
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)


@dataclass
class Family:
    """A family as the table shows it: `name` (what users call it), the transformers causal
    LM class and config class names, the tiny config's arguments, and `refused`: the reason
    words the loop's refusal must contain (None: the family must run and match HF)."""

    name: str
    model_class: str
    config_class: str
    config: dict = field(default_factory=dict)
    refused: str = None
    note: str = ""  # what the table says about a family that runs (window, softcap, MLA ...)
    hf_attention: str = None  # attention implementation of the HF reference run (None: its default)

    def available(self) -> bool:
        return hasattr(transformers, self.model_class) and hasattr(transformers, self.config_class)

    def build(self, seed: int = 0, vocab: int = VOCAB):
        """The tiny model (fp32, eval, EOS off), deterministic for `seed`."""
        torch.manual_seed(seed)
        cfg = getattr(transformers, self.config_class)(vocab_size=vocab, bos_token_id=None, eos_token_id=None,
                                                       pad_token_id=0, **self.config)
        if self.hf_attention is not None:
            cfg._attn_implementation = self.hf_attention
        model = getattr(transformers, self.model_class)(cfg).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.bos_token_id = None
        model.generation_config.pad_token_id = 0
        return model


def _moe(**extra):
    return dict(LLAMA_LIKE, **extra)


FAMILIES = [
    Family("Llama", "LlamaForCausalLM", "LlamaConfig", dict(LLAMA_LIKE)),
    Family("Mistral", "MistralForCausalLM", "MistralConfig", dict(LLAMA_LIKE, sliding_window=None)),
    Family("Mistral (sliding window)", "MistralForCausalLM", "MistralConfig", dict(LLAMA_LIKE, sliding_window=WINDOW),
           note="sliding window"),
    Family("Qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(LLAMA_LIKE, use_sliding_window=False)),
    Family("Qwen2 (sliding window)", "Qwen2ForCausalLM", "Qwen2Config",
           dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
           note="sliding window on layers >= max_window_layers"),
    Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
           _moe(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    Family("Qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(LLAMA_LIKE, head_dim=16)),
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
           _moe(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    Family("Mixtral", "MixtralForCausalLM", "MixtralConfig", _moe(num_local_experts=4, num_experts_per_tok=2)),
    Family("Phi-3", "Phi3ForCausalLM", "Phi3Config", dict(LLAMA_LIKE)),
    Family("Phi", "PhiForCausalLM", "PhiConfig", dict(LLAMA_LIKE, num_key_value_heads=4)),
    Family("GPT-2", "GPT2LMHeadModel", "GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    Family("GPT-J", "GPTJForCausalLM", "GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8)),
    Family("GPT-NeoX", "GPTNeoXForCausalLM", "GPTNeoXConfig",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256)),
    Family("OPT", "OPTForCausalLM", "OPTConfig",
           dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                word_embed_proj_dim=64)),
    Family("StableLM", "StableLmForCausalLM", "StableLmConfig", dict(LLAMA_LIKE)),
    Family("Starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", dict(LLAMA_LIKE, sliding_window=WINDOW),
           note="sliding window"),
    Family("Granite", "GraniteForCausalLM", "GraniteConfig", dict(LLAMA_LIKE)),
    Family("OLMo-2", "Olmo2ForCausalLM", "Olmo2Config", dict(LLAMA_LIKE)),
    Family("Cohere", "CohereForCausalLM", "CohereConfig", dict(LLAMA_LIKE)),
    Family("GLM-4.5 MoE", "Glm4MoeForCausalLM", "Glm4MoeConfig",
           _moe(head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, n_group=1, topk_group=1)),
    Family("Gemma 2", "Gemma2ForCausalLM", "Gemma2Config",
           dict(LLAMA_LIKE, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                final_logit_softcapping=3.0, query_pre_attn_scalar=16),
           note="sliding window on local layers, attention logit soft-capping; final-logit soft-capping is in the "
                "model's logits", hf_attention="eager"),
    Family("Gemma 3 (text)", "Gemma3ForCausalLM", "Gemma3TextConfig",
           dict(LLAMA_LIKE, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=16),
           note="local (sliding window) and global layers"),
    Family("DeepSeek-V3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
           _moe(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12),
           note="MLA: key head dim (qk_nope + qk_rope) != value head dim; the cache holds the latents"),
    Family("DeepSeek-V2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
           _moe(num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12),
           note="MLA, as DeepSeek-V3 (here without a query LoRA)"),
    Family("Gemma", "GemmaForCausalLM", "GemmaConfig", dict(LLAMA_LIKE, head_dim=16)),
    Family("Cohere 2", "Cohere2ForCausalLM", "Cohere2Config",
           dict(LLAMA_LIKE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
           note="local (sliding window) and global layers"),
    Family("Falcon", "FalconForCausalLM", "FalconConfig",
           dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                new_decoder_architecture=True),
           refused="attention interface"),
    Family("Bloom", "BloomForCausalLM", "BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4),
           refused="attention interface"),
    Family("Qwen3-Next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
           _moe(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
           refused="recurrent layers"),
    Family("Jamba", "JambaForCausalLM", "JambaConfig",
           _moe(num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=2, mamba_expand=2, mamba_dt_rank=8),
           refused="recurrent layers"),
    Family("Falcon-H1", "FalconH1ForCausalLM", "FalconH1Config",
           dict(LLAMA_LIKE, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                mamba_n_groups=1, mamba_chunk_size=16),
           refused="recurrent layers"),
    Family("Nemotron-H", "NemotronHForCausalLM", "NemotronHConfig",
           dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layer_types=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
                n_groups=1, mamba_d_conv=2, chunk_size=16),
           refused="recurrent layers"),
]
AVAILABLE = [f for f in FAMILIES if f.available()]
RUNS = [f for f in AVAILABLE if f.refused is None]
REFUSED = [f for f in AVAILABLE if f.refused is not None]
MAX_NEW = 12


def _ids(families):
    return [f.name for f in families]


def hf_reference(model, ids, mask):
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                          pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("family", RUNS, ids=_ids(RUNS))
def test_greedy_matches_hf(family):
    """n-gram tree drafts and a draft model (the target itself: drafts accepted whole), dense
    and paged caches, batch 2 with left padding: HF's tokens exactly."""
    target = family.build(0)
    ids, mask = left_pad(repetitive_prompts(2))
    expected = hf_reference(target, ids, mask)
    drafters = {"ngram tree": sk.NgramDrafter(min_n=1, max_n=3, num_tokens=4, tree_width=2),
                "draft model": sk.DraftModelDrafter(target, tree_widths=(2, 1, 1))}
    for label, drafter in drafters.items():
        for page_size in (None, 5):
            out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=MAX_NEW,
                              adaptive=False, kv_page_size=page_size)
            assert torch.equal(out.sequences, expected), f"{family.name}, {label}, page_size={page_size}"
    assert out.stats.tokens_per_step > 1.5  # self-drafting: whole drafts accepted and compacted


@pytest.mark.parametrize("family", REFUSED, ids=_ids(REFUSED))
def test_refused_at_the_start(family):
    """NotImplementedError naming the family and the reason, before any forward."""
    target = family.build(0)
    ids, mask = left_pad(repetitive_prompts(2))
    calls = []
    hook = target.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(NotImplementedError, match=family.refused) as error:
            sk.generate(target, ids, attention_mask=mask, drafter=sk.NgramDrafter(num_tokens=3), max_new_tokens=4)
    finally:
        hook.remove()
    assert target.config.model_type in str(error.value)
    assert not calls, "refused only after running the model"


def test_every_claimed_family_is_tested():
    """The families the issue names that this transformers ships are all in the list."""
    assert len(AVAILABLE) >= 25, [f.name for f in FAMILIES if not f.available()]


@pytest.mark.parametrize("name", ["Gemma 2", "DeepSeek-V3"])
def test_sampling_matches_target_distribution(name):
    """Sampled rows (n-gram tree drafts and a draft model) against the exact distribution of
    the first two tokens, chi-square."""
    family = next(f for f in AVAILABLE if f.name == name)
    target = family.build(20, vocab=SMALL_VOCAB)
    with torch.no_grad():  # sharper distributions, so that drafts are accepted and rejected
        target.get_output_embeddings().weight.mul_(8.0)
    draft = family.build(21, vocab=SMALL_VOCAB)
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    expected = exact_pair_distribution(target, SAMPLE_PROMPT)
    for drafter in (sk.NgramDrafter(num_tokens=3, tree_width=2), sk.DraftModelDrafter(draft, tree_widths=(2, 1))):
        out = sk.generate(target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=1234, adaptive=False)
        pvalue = chi_square_pvalue(out.sequences[:, -2:], expected)
        assert pvalue > 1e-3, f"{name}, {type(drafter).__name__}: chi-square p = {pvalue}"


@pytest.mark.parametrize("name, off", [("Mistral (sliding window)", dict(sliding_window=None)),
                                       ("Gemma 2", dict(sliding_window=10_000, attn_logit_softcapping=None)),
                                       ("Gemma 3 (text)", dict(sliding_window=10_000))])
def test_windows_and_caps_matter(name, off):
    """The tiny configs really exercise their window and soft-capping: HF's own output changes
    without them (so matching it in test_greedy_matches_hf is not vacuous)."""
    import dataclasses

    family = next(f for f in AVAILABLE if f.name == name)
    ids, mask = left_pad(repetitive_prompts(2))
    plain = dataclasses.replace(family, config=dict(family.config, **off))
    assert not torch.equal(hf_reference(family.build(0), ids, mask), hf_reference(plain.build(0), ids, mask))


def test_gemma2_final_logit_softcapping_is_in_the_logits():
    """Gemma 2 caps its final logits inside the model's forward, so verify gets capped logits."""
    family = next(f for f in AVAILABLE if f.name == "Gemma 2")
    target = family.build(0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        logits = target(ids).logits
    assert logits.abs().max() <= target.config.final_logit_softcapping + 1e-5


def test_table_is_current():
    """docs/models.md holds what tools/model_table.py prints from FAMILIES."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "model_table.py")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        assert f.read() == result.stdout, "docs/models.md is stale: python tools/model_table.py > docs/models.md"


@pytest.mark.parametrize("with_mask", [False, True])
def test_plain_forward_with_window_and_softcap(with_mask):
    """A forward without tree metadata (a prefill, or someone else's call with a padding mask)
    on a layer with a window and soft-capping, which SDPA lacks: our attention function against
    float64 attention with the causal, window and padding rules spelled out; Dv != D."""
    from specdec_kernels.loop.hf.attention import specdec_tree_attention

    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, q_len, kv_len, dim, value_dim, window, cap = 2, 4, 2, 7, 11, 16, 8, 3, 1.5
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, value_dim, generator=gen)
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    allowed = (k_pos <= q_pos) & (q_pos - k_pos < window)  # [T, S]
    allowed = allowed[None, None].expand(batch, 1, -1, -1).clone()
    mask = None
    if with_mask:
        allowed[1, :, :, :2] = False  # row 1: two padding slots
        mask = allowed.clone()
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = specdec_tree_attention(module, query, key, value, mask, scaling=0.3, sliding_window=window, softcap=cap)
    keys = key.double().repeat_interleave(2, dim=1)
    values = value.double().repeat_interleave(2, dim=1)
    scores = cap * torch.tanh(query.double() @ keys.transpose(2, 3) * 0.3 / cap)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    expected = (probs @ values).transpose(1, 2)  # [B, T, Hq, Dv]
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
