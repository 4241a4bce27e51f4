"""MTP drafting (`MtpDrafter`) on tiny random checkpoints written here in the real key formats.

Each checkpoint is a tiny random target saved with `save_pretrained`, plus MTP tensors added
to its safetensors under the published key names: DeepSeek-V3 / GLM-4.5
(`model.layers.{N}.enorm`, ... on a Glm4Moe MoE target), MiMo (`model.mtp_layers.{k}.` on a
Qwen2 target, MiMo's architecture) and Qwen3-Next (`mtp.*`, loader and one step only: our loop
refuses hybrid targets). The MTP block's own weights come from a random decoder layer of the
target's class at index N + k, saved by transformers in the checkpoint format (per-expert
linears for MoE), so they are what a real checkpoint holds.

Checked: the loader reads every MTP weight (nothing unused, nothing missing, clear errors
otherwise); one MTP step, and a chain of them, equals a plain-torch implementation of the
published forward written below (vLLM's / SGLang's MTP modules: norms, fused projection,
block, final norm, shared head); greedy output equals HF `generate` (chains, trees, batches
with rows finishing at different steps, two MTP layers); sampled output has the target's
distribution (chi-square); `default_drafter` picks the MTP layers when the checkpoint has them.
"""

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("scipy.stats")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

import specdec_kernels as sk  # noqa: E402
from specdec_kernels.heads import HeadNgramDrafter, MtpDrafter, default_drafter  # noqa: E402
from specdec_kernels.heads.mtp import find_mtp  # noqa: E402
from test_generate import (  # noqa: E402
    SAMPLE_PROMPT, SAMPLE_ROWS, SMALL_VOCAB, chi_square_pvalue, exact_pair_distribution, hf_greedy, left_pad,
    repetitive_prompts,
)
from test_generate import one_thread  # noqa: E402,F401

VOCAB = 96


# ----------------------------------------------------------------------------- checkpoints


def qwen2_config(vocab=VOCAB, hidden=32, layers=2):
    return transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                    tie_word_embeddings=False, use_sliding_window=False)


def glm_config(vocab=VOCAB, hidden=32, layers=2):
    return transformers.Glm4MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                      first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=256,
                                      partial_rotary_factor=0.5, use_qk_norm=True, num_nextn_predict_layers=1,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)


def qwen3_next_config(vocab=VOCAB, hidden=32, layers=2):
    return transformers.Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                        linear_value_head_dim=8, layer_types=(["linear_attention", "full_attention"] * layers)[:layers],
                                        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                        tie_word_embeddings=False)


def deepseek_v3_config(vocab=VOCAB, hidden=32, layers=2):
    """MLA (kv_lora_rank latents; key head dim 16 + 8 != value head dim 12), MoE after layer 0."""
    return transformers.DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                         n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                         first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=256,
                                         num_nextn_predict_layers=1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                         tie_word_embeddings=False)


# Test cases: the target family and the MTP layout its checkpoints use.
ARCH = {"mimo": (transformers.Qwen2ForCausalLM, qwen2_config), "glm": (transformers.Glm4MoeForCausalLM, glm_config),
        "deepseek_v3": (transformers.DeepseekV3ForCausalLM, deepseek_v3_config),
        "qwen3_next": (transformers.Qwen3NextForCausalLM, qwen3_next_config)}
LAYOUT = {"mimo": "mimo", "glm": "deepseek", "deepseek_v3": "deepseek", "qwen3_next": "qwen3_next"}


def mtp_prefix(layout, n, k):
    return {"deepseek": f"model.layers.{n + k}.", "mimo": f"model.mtp_layers.{k}.", "qwen3_next": f"mtp.layers.{k}."}[layout]


def write_checkpoint(folder, case, seed=0, num_mtp=1, logit_scale=1.0, vocab=VOCAB, hidden=32, extra=None, drop=None):
    """A tiny random target of the layout's family saved in `folder`, with `num_mtp` MTP
    layers added to its model.safetensors under the layout's real key names. Returns the
    target (reloaded from `folder`, as a user would) and the MTP tensors written."""
    cls, make_config = ARCH[case]
    layout = LAYOUT[case]
    torch.manual_seed(seed)
    config = make_config(vocab=vocab, hidden=hidden)
    target = cls(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(logit_scale)
        for name, p in target.named_parameters():  # random norms (ones would hide a missing norm)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    target.save_pretrained(folder)
    n = config.num_hidden_layers
    # The blocks: decoder layers N .. N + num_mtp - 1 of a deeper model of the same class, in
    # the checkpoint format transformers writes.
    deep_config = make_config(vocab=vocab, hidden=hidden, layers=n + num_mtp)
    if layout == "qwen3_next":  # (the MTP block is a full-attention layer)
        deep_config.layer_types = list(config.layer_types) + ["full_attention"] * num_mtp
    deep = cls(deep_config)
    deep.save_pretrained(folder / "deep")
    deep_tensors = load_file(str(folder / "deep" / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    norm = lambda: 1.0 + 0.3 * torch.randn(hidden, generator=g)  # noqa: E731
    mtp = {}
    for k in range(num_mtp):
        src, dst = f"model.layers.{n + k}.", mtp_prefix(layout, n, k)
        mtp.update({dst + key[len(src):]: t for key, t in deep_tensors.items() if key.startswith(src)})
        if layout == "deepseek":
            mtp.update({dst + "enorm.weight": norm(), dst + "hnorm.weight": norm(), dst + "eh_proj.weight": rand(hidden, 2 * hidden),
                        dst + "shared_head.norm.weight": norm(),
                        dst + "shared_head.head.weight": target.lm_head.weight.detach().clone(),
                        dst + "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone()})
        elif layout == "mimo":
            mtp.update({dst + "token_layernorm.weight": norm(), dst + "hidden_layernorm.weight": norm(),
                        dst + "input_proj.weight": rand(hidden, 2 * hidden), dst + "final_layernorm.weight": norm()})
    if layout == "qwen3_next":  # zero-centred norms there: weight 0 means scale 1
        mtp.update({"mtp.pre_fc_norm_embedding.weight": norm() - 1, "mtp.pre_fc_norm_hidden.weight": norm() - 1,
                    "mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.norm.weight": norm() - 1})
    mtp.update(extra or {})
    for key in drop or ():
        mtp.pop(key)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, **{k: v.contiguous() for k, v in mtp.items()}}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    import shutil

    shutil.rmtree(folder / "deep")
    loaded = cls.from_pretrained(folder).eval()  # transformers drops the MTP keys
    return loaded, mtp


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (target, mtp tensors, folder)}; Qwen3-Next (a hybrid of linear and full
    attention layers, which our loop cannot run) is only loaded and stepped."""
    out = {}
    for case in ARCH:
        folder = tmp_path_factory.mktemp(case)
        target, mtp = write_checkpoint(folder, case, logit_scale=4.0)
        out[case] = (target, mtp, folder)
    return out


# ----------------------------------------------------------------------------- the published forward, in plain torch


def rms(x, w, eps, centred=False):
    x32 = x.double()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (1.0 + w.double()) * y if centred else w.double() * y


def rope(x, positions, theta, rot):
    """Rotate-half RoPE on the first `rot` dims of x [T, H, D] at positions [T]."""
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = positions.double()[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    return torch.cat([xr * cos + rotated * sin, xp], -1)


def lin(W, key, x):
    y = x @ W[key + ".weight"].double().T
    return y + W[key + ".bias"].double() if key + ".bias" in W else y


def mla(W, p, h, positions, cfg):
    """DeepSeek-V3's multi-head latent attention on h [T, H] (causal): queries through the
    q LoRA, keys and values expanded from the normed kv latent, RoPE (interleaved pairs) on
    the rope parts, keys sharing one rope part across heads."""
    eps, heads, t = cfg.rms_norm_eps, cfg.num_attention_heads, h.shape[0]
    nope, rot, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = lin(W, p + "self_attn.q_b_proj", rms(lin(W, p + "self_attn.q_a_proj", h), W[p + "self_attn.q_a_layernorm.weight"], eps))
    q = q.view(t, heads, nope + rot)
    latent, k_rot = lin(W, p + "self_attn.kv_a_proj_with_mqa", h).split([cfg.kv_lora_rank, rot], -1)
    kv = lin(W, p + "self_attn.kv_b_proj", rms(latent, W[p + "self_attn.kv_a_layernorm.weight"], eps)).view(t, heads, nope + vd)
    k_nope, v = kv.split([nope, vd], -1)

    def rope_pairs(x):  # interleaved pairs (x0, x1), (x2, x3) ...: de-interleave, then rotate-half RoPE
        x = torch.cat([x[..., 0::2], x[..., 1::2]], -1) if cfg.rope_interleave else x
        return rope(x, positions, cfg.rope_parameters["rope_theta"], rot)

    q = torch.cat([q[..., :nope], rope_pairs(q[..., nope:])], -1)
    k = torch.cat([k_nope, rope_pairs(k_rot[:, None, :]).expand(-1, heads, -1)], -1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(nope + rot)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return lin(W, p + "self_attn.o_proj", torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1))


def block(W, p, x, positions, cfg):
    """One decoder layer (Qwen2 dense, GLM-4.5 MoE, DeepSeek-V3 MLA + MoE) on x [T, H] with
    causal attention."""
    eps = cfg.rms_norm_eps
    if p + "self_attn.kv_a_proj_with_mqa.weight" in W:
        x = x + mla(W, p, rms(x, W[p + "input_layernorm.weight"], eps), positions, cfg)
        return moe_or_mlp(W, p, x, cfg)
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    t = x.shape[0]
    h = rms(x, W[p + "input_layernorm.weight"], eps)
    q = lin(W, p + "self_attn.q_proj", h).view(t, heads, hd)
    k = lin(W, p + "self_attn.k_proj", h).view(t, kv, hd)
    v = lin(W, p + "self_attn.v_proj", h).view(t, kv, hd)
    if p + "self_attn.q_norm.weight" in W:
        q, k = rms(q, W[p + "self_attn.q_norm.weight"], eps), rms(k, W[p + "self_attn.k_norm.weight"], eps)
    theta = cfg.rope_parameters["rope_theta"]
    rot = int(hd * cfg.rope_parameters.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    q, k = rope(q, positions, theta, rot), rope(k, positions, theta, rot)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1)
    x = x + lin(W, p + "self_attn.o_proj", attn)
    return moe_or_mlp(W, p, x, cfg)


def moe_or_mlp(W, p, x, cfg):
    """The second half of a decoder layer: post-attention norm, then the dense MLP or the
    GLM-4.5 / DeepSeek-V3 MoE, residual added."""
    h = rms(x, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    t = x.shape[0]
    mlp = lambda q_, z: lin(W, q_ + "down_proj", torch.nn.functional.silu(lin(W, q_ + "gate_proj", z)) * lin(W, q_ + "up_proj", z))  # noqa: E731
    if p + "mlp.gate.weight" not in W:
        return x + mlp(p + "mlp.", h)
    # GLM-4.5 / DeepSeek-V3 MoE: sigmoid router with a score-correction bias for the choice, top-k experts
    # (one group here), weights renormalised and scaled, plus the shared experts.
    scores = torch.sigmoid(h @ W[p + "mlp.gate.weight"].double().T)
    choice = scores + W[p + "mlp.gate.e_score_correction_bias"].double()
    top = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, top)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * cfg.routed_scaling_factor
    out = mlp(p + "mlp.shared_experts.", h)
    for i in range(t):
        for j in range(top.shape[1]):
            out[i] = out[i] + weights[i, j] * mlp(p + f"mlp.experts.{int(top[i, j])}.", h[i : i + 1])[0]
    return x + out


def block_qwen3_next(W, p, x, positions, cfg):
    """Qwen3-Next's full-attention decoder layer (zero-centred norms, gated attention, softmax
    router with a sigmoid-gated shared expert) on x [T, H] with causal attention."""
    eps, heads, kv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = x.shape[0]
    h = rms(x, W[p + "input_layernorm.weight"], eps, centred=True)
    q, gate = lin(W, p + "self_attn.q_proj", h).view(t, heads, 2 * hd).chunk(2, dim=-1)
    q = rms(q, W[p + "self_attn.q_norm.weight"], eps, centred=True)
    k = rms(lin(W, p + "self_attn.k_proj", h).view(t, kv, hd), W[p + "self_attn.k_norm.weight"], eps, centred=True)
    v = lin(W, p + "self_attn.v_proj", h).view(t, kv, hd)
    rot = int(hd * cfg.rope_parameters["partial_rotary_factor"])
    q, k = rope(q, positions, cfg.rope_parameters["rope_theta"], rot), rope(k, positions, cfg.rope_parameters["rope_theta"], rot)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    x = x + lin(W, p + "self_attn.o_proj", attn)
    h = rms(x, W[p + "post_attention_layernorm.weight"], eps, centred=True)
    mlp = lambda q_, z: lin(W, q_ + "down_proj", torch.nn.functional.silu(lin(W, q_ + "gate_proj", z)) * lin(W, q_ + "up_proj", z))  # noqa: E731
    probs = (h @ W[p + "mlp.gate.weight"].double().T).softmax(-1)
    weights, top = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.sigmoid(lin(W, p + "mlp.shared_expert_gate", h)) * mlp(p + "mlp.shared_expert.", h)
    for i in range(t):
        for j in range(top.shape[1]):
            out[i] = out[i] + weights[i, j] * mlp(p + f"mlp.experts.{int(top[i, j])}.", h[i : i + 1])[0]
    return x + out


def reference_mtp(target, W, layout, hidden, tokens, positions, k=0):
    """The published MTP forward of layer k over entries (hidden[i], tokens[i]) at
    positions[i] with causal attention: (what the layer returns, fed deeper; logits)."""
    cfg = target.config
    n, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = mtp_prefix(layout, n, k)
    emb = target.model.embed_tokens.weight.detach().double()[tokens]
    emb = emb.masked_fill((positions == 0)[:, None], 0.0)
    lm_head = target.lm_head.weight.detach().double()
    if layout == "deepseek":
        x = lin(W, p + "eh_proj", torch.cat([rms(emb, W[p + "enorm.weight"], eps), rms(hidden, W[p + "hnorm.weight"], eps)], -1))
        x = block(W, p, x, positions, cfg)
        return x, rms(x, W[p + "shared_head.norm.weight"], eps) @ W[p + "shared_head.head.weight"].double().T
    if layout == "qwen3_next":  # no position-0 zeroing; one set of norms and fc for all layers
        emb = target.model.embed_tokens.weight.detach().double()[tokens]
        x = lin(W, "mtp.fc", torch.cat([rms(emb, W["mtp.pre_fc_norm_embedding.weight"], eps, centred=True),
                                        rms(hidden, W["mtp.pre_fc_norm_hidden.weight"], eps, centred=True)], -1))
        x = rms(block_qwen3_next(W, p, x, positions, cfg), W["mtp.norm.weight"], eps, centred=True)
        return x, x @ lm_head.T
    x = lin(W, p + "input_proj", torch.cat([rms(hidden, W[p + "hidden_layernorm.weight"], eps),
                                            rms(emb, W[p + "token_layernorm.weight"], eps)], -1))
    x = rms(block(W, p, x, positions, cfg), W[p + "final_layernorm.weight"], eps)
    return x, x @ lm_head.T


def target_features(target, tokens):
    """The target's LM-head input at every position of `tokens` [L] (float64)."""
    with torch.no_grad():
        return target.model(tokens[None]).last_hidden_state[0].double()


def start_drafter(drafter, target, prompts):
    """start + observe on left-aligned prompts, as generate does after the prefill."""
    lengths = torch.tensor([len(p) for p in prompts])
    history = torch.zeros(len(prompts), 64, dtype=torch.long)
    for b, p in enumerate(prompts):
        history[b, : len(p)] = torch.tensor(p)
    with torch.no_grad():
        hidden = target.model(history[:, : int(lengths.max()) - 1]).last_hidden_state
    drafter.start(history, lengths, 64)
    drafter.observe(hidden)
    return history, lengths


# ----------------------------------------------------------------------------- loading


@pytest.mark.parametrize("case", list(ARCH))
def test_loader_reads_every_mtp_weight(checkpoints, case):
    target, mtp, folder = checkpoints[case]
    layout = LAYOUT[case]
    drafter = MtpDrafter(target)  # the directory the target was loaded from
    assert drafter.head.layout == layout and drafter.num_layers == 1
    assert sorted(drafter.head.loaded_keys) == sorted(mtp)  # every MTP key read, nothing else
    layer = drafter.head.layers[0]
    prefix = mtp_prefix(layout, target.config.num_hidden_layers, 0)
    proj = {"deepseek": prefix + "eh_proj", "mimo": prefix + "input_proj", "qwen3_next": "mtp.fc"}[layout]
    assert torch.equal(layer.proj.weight, mtp[proj + ".weight"])
    attn = layer.block.self_attn
    q = ("q_b_proj" if getattr(attn, "q_proj", None) is None else "q_proj") + ".weight"  # (MLA: the q LoRA)
    assert torch.equal(attn.get_submodule(q.rsplit(".", 1)[0]).weight, mtp[prefix + "self_attn." + q])
    if layout != "mimo":  # per-expert linears fused as transformers keeps them
        gate_up = layer.block.mlp.experts.gate_up_proj
        assert torch.equal(gate_up[2], torch.cat([mtp[prefix + "mlp.experts.2.gate_proj.weight"],
                                                  mtp[prefix + "mlp.experts.2.up_proj.weight"]]))
        assert torch.equal(layer.block.mlp.experts.down_proj[3], mtp[prefix + "mlp.experts.3.down_proj.weight"])
    # The target's LM head and embedding are used as they are (the checkpoint's equal copies are not kept).
    assert drafter.w_draft.data_ptr() == target.lm_head.weight.data_ptr()
    assert layer.own_head is None and layer.own_embed is None
    assert find_mtp(target)["layout"] == layout


def test_loader_errors(tmp_path, checkpoints):
    target, mtp, folder = checkpoints["mimo"]
    plain = transformers.Qwen2ForCausalLM(qwen2_config()).eval()
    plain.save_pretrained(tmp_path / "plain")
    plain = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"no MTP layers .*model\.layers\.2\.eh_proj\.weight.*model\.mtp_layers\.0\.input_proj"):
        MtpDrafter(plain)
    assert find_mtp(plain) is None
    assert isinstance(default_drafter(plain), sk.ScoredMergedDrafter)  # no MTP layers, no trained head: n-gram + suffix cache
    with pytest.raises(ValueError, match="checkpoint_dir"):
        MtpDrafter(target, checkpoint_dir=tmp_path / "nowhere")
    # An unknown key under the MTP prefix, a missing one, an unknown layout.
    _, _ = write_checkpoint(tmp_path / "extra", "mimo", extra={"model.mtp_layers.0.surprise.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"model\.mtp_layers\.0\.surprise\.weight"):
        MtpDrafter(target, checkpoint_dir=tmp_path / "extra")
    write_checkpoint(tmp_path / "missing", "mimo", drop=["model.mtp_layers.0.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match=r"lacks model\.mtp_layers\.0\.self_attn\.k_proj\.weight"):
        MtpDrafter(target, checkpoint_dir=tmp_path / "missing")
    write_checkpoint(tmp_path / "odd", "mimo", drop=["model.mtp_layers.0.input_proj.weight"])
    with pytest.raises(ValueError, match=r"no MTP layers .*keys in no layout we know: model\.mtp_layers\.0\."):
        MtpDrafter(target, checkpoint_dir=tmp_path / "odd")


# ----------------------------------------------------------------------------- the forward


@pytest.mark.parametrize("case", list(ARCH))
def test_one_step_and_chain_equal_the_published_forward(checkpoints, case):
    """Ragged batch: the root's children carry the MTP layer's probabilities at the last
    entry; a greedy chain of 3 feeds each draft back (with the layer's output), as the
    published forward run on the extended sequence."""
    target, W, _ = checkpoints[case]
    layout = LAYOUT[case]
    prompts = [[5, 17, 3, 9, 44, 2, 8], [7, 1, 30, 12]]
    wide = MtpDrafter(target, max_nodes=VOCAB, depth=1, top_k=VOCAB, min_score=0.0)
    history, lengths = start_drafter(wide, target, prompts)
    draft = wide.propose(history, lengths)
    chain = MtpDrafter(target, num_tokens=3, min_score=0.0)
    start_drafter(chain, target, prompts)
    drafted = chain.propose(history, lengths)
    for b, p in enumerate(prompts):
        tokens = torch.tensor(p)
        feats = target_features(target, tokens)[:-1]
        positions = torch.arange(len(p) - 1)
        out, logits = reference_mtp(target, W, layout, feats, tokens[1:], positions)
        probs = logits[-1].softmax(-1)
        got = torch.zeros(VOCAB, dtype=torch.float64)
        nodes = draft.tree.tokens[b, 1:]
        got[nodes] = draft.scores[b, 1:].double()
        assert torch.allclose(got, probs, atol=1e-5), (b, (got - probs).abs().max())
        # The chain: depth d + 1 reads (output at the last entry, depth-d token) one position on.
        score, seq_h, seq_t = 1.0, feats, tokens[1:]
        for depth in range(1, 4):
            token = int(logits[-1].argmax())
            score *= float(logits[-1].softmax(-1)[token])
            assert int(drafted.tree.tokens[b, depth]) == token and int(drafted.tree.parents[b, depth]) == depth - 1
            assert abs(float(drafted.scores[b, depth]) - score) < 1e-5
            seq_h, seq_t = torch.cat([seq_h, out[-1:]]), torch.cat([seq_t, torch.tensor([token])])
            out, logits = reference_mtp(target, W, layout, seq_h, seq_t, torch.arange(seq_t.numel()))


# ----------------------------------------------------------------------------- generate


MTP_DRAFTERS = {
    "chain": lambda t: MtpDrafter(t, num_tokens=3, min_score=0.0),
    "tree": lambda t: MtpDrafter(t, max_nodes=8, depth=3, top_k=3, min_score=0.0),
    "default": lambda t: default_drafter(t),
}


@pytest.mark.parametrize("kind", list(MTP_DRAFTERS))
@pytest.mark.parametrize("case", ["mimo", "glm", "deepseek_v3"])
def test_greedy_matches_hf_generate(checkpoints, case, kind):
    """Batch of 3 (left padding, a one-token prompt) with an eos that rows meet at different
    steps: rows leave the batch while the MTP caches follow."""
    target, _, _ = checkpoints[case]
    prompts = [[5], *repetitive_prompts(2)]
    prompts = [[t % VOCAB for t in p] for p in prompts]
    ids, mask = left_pad(prompts)
    plain = sk.generate(target, ids, attention_mask=mask, max_new_tokens=20).sequences
    eos = int(plain[1, ids.shape[1] + 4])
    expected = hf_greedy(target, ids, mask, 20, eos_token_id=eos)
    drafter = MTP_DRAFTERS[kind](target)
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert len(set(out.stats.new_tokens)) > 1  # rows finished at different steps
    free = sk.generate(target, ids, attention_mask=mask, drafter=MTP_DRAFTERS[kind](target), max_new_tokens=20,
                       adaptive=False)
    assert torch.equal(free.sequences, hf_greedy(target, ids, mask, 20))
    assert free.stats.nodes_per_step > 0  # the MTP layers drafted
    if kind == "default":
        assert isinstance(drafter, HeadNgramDrafter) and isinstance(drafter.head_drafter, MtpDrafter)


def test_paged_target_cache_and_bf16(checkpoints):
    """The MTP layers' cache is the drafter's own: a paged target cache changes nothing, and
    a bf16 target drafts in bf16 (greedy still equals HF's, in bf16 on both sides)."""
    target, _, _ = checkpoints["glm"]
    ids, mask = left_pad([[t % VOCAB for t in p] for p in repetitive_prompts(2, seed=9)])
    out = sk.generate(target, ids, attention_mask=mask, drafter=MtpDrafter(target, max_nodes=6, top_k=2, min_score=0.0),
                      max_new_tokens=16, adaptive=False, kv_page_size=4)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))
    half = copy.deepcopy(target).to(torch.bfloat16)
    drafter = MtpDrafter(half, num_tokens=2, min_score=0.0)
    assert drafter.dtype == torch.bfloat16 and drafter.w_draft.data_ptr() == half.lm_head.weight.data_ptr()
    out = sk.generate(half, ids, attention_mask=mask, drafter=drafter, max_new_tokens=12, adaptive=False)
    assert torch.equal(out.sequences, hf_greedy(half, ids, mask, 12))


def test_fused_block_drafts_as_the_modules(checkpoints):
    """A one-layer MTP head whose block is a Llama-family layer (MiMo's Qwen2 block here) runs
    as one `decoder_layer` op on a CPU: its trees equal the torch modules' over a ragged batch
    and two steps (the second catches up 3, 1 and 0 new entries), scores to rounding. MoE and
    MLA blocks keep the modules."""
    target, _, _ = checkpoints["mimo"]
    fused, plain = (MtpDrafter(target, max_nodes=10, depth=3, top_k=3, min_score=0.0) for _ in range(2))
    plain._fused = None
    for drafter in (fused, plain):  # (separate copies of the block; in place, so the fused weights follow)
        with torch.no_grad():
            drafter.head.layers[0].block.self_attn.o_proj.weight.mul_(20.0)
    assert MtpDrafter(checkpoints["glm"][0]).fused_block() is None
    assert MtpDrafter(checkpoints["deepseek_v3"][0]).fused_block() is None
    if fused.fused_block() is None:
        pytest.skip("no compiled decoder_layer kernel")
    prompts = [[5, 17, 3, 9, 44, 2, 8, 5, 17], [7, 1, 30, 12, 7, 1], [9, 9, 4, 2, 11, 9, 9, 4]]
    history, lengths = start_drafter(fused, target, prompts)
    start_drafter(plain, target, prompts)
    for step in range(2):
        a, b = fused.propose(history, lengths), plain.propose(history, lengths)
        assert torch.equal(a.tree.tokens, b.tree.tokens) and torch.equal(a.tree.parents, b.tree.parents), step
        assert torch.allclose(a.scores, b.scores, atol=1e-5), step
        assert int(a.tree.num_nodes.min()) == 11
        for row, n in enumerate([3, 1, 0]):
            history[row, lengths[row] : lengths[row] + n] = history[row, :n]
        lengths = lengths + torch.tensor([3, 1, 0])
        with torch.no_grad():
            hidden = target.model(history[:, : int(lengths.max()) - 1]).last_hidden_state
        fused.observe(hidden)
        plain.observe(hidden)


def test_reduced_draft_vocabulary(checkpoints):
    """draft_vocab= restricts the drafts to those ids (a copy of those LM-head rows); the
    scores are the MTP layer's softmax over them; output stays the target's."""
    target, _, _ = checkpoints["mimo"]
    ids = torch.arange(0, VOCAB, 3)
    drafter = MtpDrafter(target, draft_vocab=ids, max_nodes=8, depth=2, top_k=4, min_score=0.0)
    history, lengths = start_drafter(drafter, target, [[5, 17, 3, 9, 44, 2, 8], [7, 1, 30, 12]])
    tree = drafter.propose(history, lengths).tree
    assert bool(torch.isin(tree.tokens[tree.parents >= 0], ids).all())
    prompts, mask = left_pad([[t % VOCAB for t in p] for p in repetitive_prompts(2, seed=4)])
    out = sk.generate(target, prompts, attention_mask=mask, drafter=drafter, max_new_tokens=16, adaptive=False)
    assert torch.equal(out.sequences, hf_greedy(target, prompts, mask, 16))
    with pytest.raises(ValueError, match="draft_vocab"):
        MtpDrafter(target, draft_vocab=torch.tensor([0, VOCAB]))


def test_two_mtp_layers(tmp_path):
    """A checkpoint with two MTP layers (DeepSeek layout, layers N and N + 1): both load,
    depth 2 uses the second, and greedy output is still the target's."""
    target, mtp = write_checkpoint(tmp_path, "glm", num_mtp=2, seed=3, logit_scale=4.0)
    drafter = MtpDrafter(target, num_tokens=4)
    assert drafter.num_layers == 2 and sorted(drafter.head.loaded_keys) == sorted(mtp)
    ids, mask = left_pad([[t % VOCAB for t in p] for p in repetitive_prompts(2, seed=5)])
    out = sk.generate(target, ids, attention_mask=mask, drafter=drafter, max_new_tokens=16, adaptive=False)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    return write_checkpoint(folder, "mimo", seed=20, vocab=SMALL_VOCAB, logit_scale=8.0)[0]


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampling_matches_target_distribution(small_checkpoint, kind):
    target = small_checkpoint
    drafter = MtpDrafter(target, num_tokens=2) if kind == "chain" else MtpDrafter(target, max_nodes=6, depth=2, top_k=3)
    ids = torch.tensor(SAMPLE_PROMPT).expand(SAMPLE_ROWS, -1)
    out = sk.generate(target, ids, drafter=drafter, max_new_tokens=2, temperature=1.0, seed=77, adaptive=False)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT))
    assert pvalue > 1e-3, f"{kind}: chi-square p = {pvalue}"
    assert 0.02 < out.stats.acceptance_per_depth[0] < 0.98  # drafts accepted and rejected
    args = dict(temperature=0.7, top_k=5, top_p=0.9)
    out = sk.generate(target, ids, drafter=drafter, max_new_tokens=2, seed=78, adaptive=False, **args)
    pvalue = chi_square_pvalue(out.sequences[:, -2:], exact_pair_distribution(target, SAMPLE_PROMPT, **args))
    assert pvalue > 1e-3, f"{kind} warped: chi-square p = {pvalue}"
