"""The heads' own networks (plain torch, no transformers dependency).

`EagleHead`: EAGLE's draft network. Input at position i is the target's feature f_i (the LM
head's input at i) and the embedding of the next token x_{i+1}; `fc` maps their
concatenation to the hidden size, one Llama decoder layer (RMSNorm, RoPE attention with
grouped KV heads, SiLU MLP: the target's own shapes) runs over the sequence with causal
attention, and a final RMSNorm gives g_i, the head's prediction of f_{i+1}. Logits are the
target's frozen LM head applied to g_i (restricted to the draft vocabulary), so the head
predicts token x_{i+2}. Drafting feeds g back in as the next feature.

With `feature_layers` (EAGLE-3's multi-layer features), f_i is instead `fuse` applied to
several of the target's hidden states at i (low, middle and high layers: more of what the
target knows about the tokens after x_{i+1} than its last layer, which is tuned to predict
x_{i+1} alone); drafted depths still feed g, so the head learns to read its own outputs
(training-time test, `train.eagle_passes`).

`MedusaHeads`: K residual blocks on the target's feature f_t; head k (1-based) predicts
token x_{t+1+k} through the target's LM head (the target itself predicts x_{t+1}).
"""

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .common import block_mask, cache_kwarg


def init_decoder_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """The heads' deterministic init (EagleHead's, and MtpHead's block of the target's own
    classes): biases 0, every other weight normal(0, 0.02) drawn in parameter order, the
    residual-stream output projections (o_proj, down_proj) scaled by 1/sqrt(2) so a fresh
    decoder layer starts close to the identity on its residual stream, except norm weights,
    left as their class builds them (1 for Llama's RMSNorm, 0 for a zero-centred one such as
    Gemma's, which scales by 1 + weight)."""
    for name, p in module.named_parameters():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if "norm" in owner.rsplit(".", 1)[-1]:
            continue
        if name.endswith("bias"):
            nn.init.zeros_(p)
            continue
        output_projection = owner.rsplit(".", 1)[-1] in ("o_proj", "down_proj")
        std = 0.02 / (math.sqrt(2.0) if output_projection else 1.0)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=generator) * std)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (computed in fp32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(positions: torch.Tensor, dim: int, theta: float, dtype=torch.float32):
    """(cos, sin) [B, T, dim] of RoPE (HF Llama's rotate-half layout) at positions [B, T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (the rotate-half layout of HF Llama) on x [B, T, heads, D] at positions [B, T]."""
    dim = x.shape[-1]
    cos, sin = rope(positions, dim, theta, x.dtype)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def causal_attention(q, k, v):
    """Attention with a causal mask over the sequence itself (training). q [B, T, Hq, D],
    k, v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class EagleHead(nn.Module):
    """fc + one Llama decoder layer + final norm (see the module docstring).

    Args (the keys of `config`): hidden_size, num_attention_heads, num_key_value_heads,
    head_dim, intermediate_size, rms_norm_eps, rope_theta (the target's values),
    draft_vocab_size (N: how many target tokens the head can propose), and optionally
    feature_layers (the target's hidden-state indices fused into the head's input feature,
    transformers' numbering; absent: its LM head input alone).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        h, nh, nkv, hd = (int(config[k]) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
        inter, eps = int(config["intermediate_size"]), float(config["rms_norm_eps"])
        self.num_heads, self.num_kv_heads, self.head_dim, self.theta = nh, nkv, hd, float(config["rope_theta"])
        self.feature_layers = tuple(int(i) for i in config.get("feature_layers") or ())
        self.fuse = nn.Linear(len(self.feature_layers) * h, h, bias=False) if self.feature_layers else None
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.input_norm = RMSNorm(h, eps)
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.post_norm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = RMSNorm(h, eps)
        self.register_buffer("draft_vocab", torch.zeros(int(config["draft_vocab_size"]), dtype=torch.int64))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Deterministic init: normal(0, 0.02) weights, output projections scaled down (so
        the layer starts close to the identity on its residual stream), zero biases, norms as
        built (1): `init_decoder_parameters`."""
        init_decoder_parameters(self, generator)

    def input_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input feature from the target's hidden states: hidden [..., H] (the LM
        head's input) as is, or with `feature_layers` hidden [..., len(feature_layers), H]
        fused to [..., H]."""
        if self.fuse is None:
            return hidden
        return self.fuse(hidden.flatten(-2))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                attend: Optional[Callable] = None) -> torch.Tensor:
        """features (`input_features`, or the head's own outputs g when drafting deeper),
        token_embeds [B, T, H], positions [B, T] -> g [B, T, H].

        attend(q, k, v) -> [B, T, Hq, D] does the attention (RoPE already applied):
        default causal over the T inputs; drafting passes one that also reads and writes a
        KV cache."""
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = rotate(self.q_proj(h).view(b, t, self.num_heads, self.head_dim), positions, self.theta)
        k = rotate(self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim), positions, self.theta)
        v = self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        attn = (attend or causal_attention)(q, k, v)
        x = x + self.o_proj(attn.reshape(b, t, -1))
        h = self.post_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.norm(x)


class MedusaHeads(nn.Module):
    """K residual blocks r_k(f) = f + SiLU(W_k f + b_k) on the target's feature f_t; head k
    predicts token x_{t+1+k} as the target's LM head applied to r_k(f_t).

    Args (keys of `config`): hidden_size, num_heads (K), draft_vocab_size (N).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)
        h, k = int(config["hidden_size"]), int(config["num_heads"])
        self.weight = nn.Parameter(torch.zeros(k, h, h))
        self.bias = nn.Parameter(torch.zeros(k, h))
        self.register_buffer("draft_vocab", torch.zeros(int(config["draft_vocab_size"]), dtype=torch.int64))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Zero init (Medusa's choice): every head starts as the target's own next-token head."""
        with torch.no_grad():
            self.weight.zero_()
            self.bias.zero_()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., H] -> [..., K, H]."""
        pre = torch.einsum("...h,kgh->...kg", features, self.weight) + self.bias
        return features.unsqueeze(-2) + F.silu(pre)


class _SharedHead(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm


class MtpHead(nn.Module):
    """A DeepSeek-V3-layout MTP layer to train for a target that has none (`kind="mtp"`):
    x = eh_proj(concat(enorm(e), hnorm(f_i))) with e = embed(x_{i+1}) (zeroed at position 0,
    as vLLM feeds MTP layers), x = block(x), g = shared_head.norm(x). g's logits through the
    target's LM head predict x_{i+2} (and g is regressed on f_{i+1}, as EAGLE's output is);
    drafting deeper feeds x (not g) back in as the next hidden state, as DeepSeek-V3's MTP
    module returns it.

    The block is a decoder layer of the target's own class, built by the caller
    (`train.build_mtp_head`: `heads.mtp` builds the same one to draft), and the norms are
    the target's own RMSNorm class (`make_norm()`); this module only wires them, so it needs
    no transformers import. `rotary(x, positions) -> (cos, sin)` is the target's rotary
    embedding (held, not owned: it is not part of the head's weights). additive_mask: the
    block's attention adds its mask to the scores (eager attention) instead of taking a
    boolean one.

    Parameter names are the checkpoint's (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
    and the block's own, e.g. `self_attn.q_proj`), so `checkpoint_state(N)` is what
    `MtpDrafter` loads. config keys: hidden_size, draft_vocab_size, layer_index (N),
    block_class (the block's class name, recorded).
    """

    def __init__(self, config: dict, block: nn.Module, make_norm: Callable[[], nn.Module], rotary: Callable,
                 additive_mask: bool = False):
        super().__init__()
        self.config = dict(config)
        h = int(config["hidden_size"])
        self.feature_layers, self.fuse = (), None
        self.enorm, self.hnorm = make_norm(), make_norm()
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.shared_head = _SharedHead(make_norm())
        self._rotary = (rotary,)  # a tuple: not registered as a submodule (not the head's weights)
        self.additive_mask = bool(additive_mask)
        self._cache_kwarg = cache_kwarg(block)
        self.register_buffer("draft_vocab", torch.zeros(int(config["draft_vocab_size"]), dtype=torch.int64))

    def reset_parameters(self, generator: torch.Generator) -> None:
        """`init_decoder_parameters` (norms as their class builds them, normal(0, 0.02) weights)."""
        init_decoder_parameters(self, generator)

    def input_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM-head input as is (no multi-layer fusion)."""
        return hidden

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache=None, mask: Optional[torch.Tensor] = None, return_hidden: bool = False):
        """features [B, T, H] (the target's, or x of the previous depth), token_embeds [B, T, H],
        positions [B, T] -> g [B, T, H] (with return_hidden: (g, x), x fed to the next depth).

        mask: boolean [B or 1, T, S] over the keys the block's attention sees (default causal
        over the T inputs); cache: an object with the transformers Cache `update` method that
        returns the keys/values attention reads (S of them), for unrolled passes."""
        token_embeds = token_embeds.masked_fill((positions == 0)[..., None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(features)], dim=-1))
        t = x.shape[1]
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None]
        cos_sin = self._rotary[0](x, positions)
        kwargs = {self._cache_kwarg: cache, "use_cache": True} if cache is not None else {}
        out = self.block(x, attention_mask=block_mask(mask[:, None], self.additive_mask, x.dtype), position_ids=positions, position_embeddings=cos_sin, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
        g = self.shared_head.norm(x)
        return (g, x) if return_hidden else g

    def checkpoint_state(self, layer_index: int) -> dict:
        """The weights under their DeepSeek-V3 checkpoint names, `model.layers.{layer_index}.*`
        (layer_index: the target's num_hidden_layers; the block's parameters without the
        `block.` prefix), plus `draft_vocab` (outside the prefix, which the MTP loader ignores)."""
        state = {}
        for k, v in self.state_dict().items():
            if k == "draft_vocab":
                continue
            state[f"model.layers.{layer_index}.{k[len('block.'):] if k.startswith('block.') else k}"] = v
        return {**state, "draft_vocab": self.draft_vocab}
