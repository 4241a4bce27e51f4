"""A lean tree-step forward for Llama-family decoders on a CPU: transformers' math, fewer ops.

A decode step of a small model on a CPU is dominated by the weights' bytes and, after them,
by the forward's own overhead: transformers' modules run ~65 torch ops per decoder layer
(module calls, hooks machinery, kwargs plumbing, dtype round trips, mask and cache bookkeeping).
On the default model (30 layers, fp32, one thread) that was ~13 ms of a ~55 ms step, which
llama.cpp does not pay. `LeanForward` runs a tree step of the same model with ~30 ops per
layer: it calls each linear's and RMSNorm's `forward` directly (our `small_linear` where
`small_linears` routed a linear), applies the rotary embedding to queries and keys in their [B, T, H, D] layout,
writes the `TreeKVCache` and runs `tree_attention` as the attention function does.

It computes what transformers' modules compute, op for op in the same order and dtype
(their own RMSNorms, `q * cos + rotate_half(q) * sin`, `down(act(gate(x)) * up(x))`, the same
residual adds), so its logits are bit-identical to `hf.forward`'s; `python_tests/
test_lean_forward.py` checks that for every family it takes, dense and paged caches, ragged
rows and every `return_hidden` form.

It takes only what it can prove equal (`LeanForward.for_model` returns None otherwise, and
`generate` runs the model's own forward): Llama, Mistral, Qwen2 and Qwen3 causal LMs whose layers
are exactly transformers' classes, on a CPU, SiLU MLPs without biases, every layer full
attention (no sliding window), no tensor parallelism, no forward hooks on any module.
`config.lean_forward = False` (or SPECDEC_LEAN_FORWARD=0 at import) turns it off.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F

from ... import config
from ...ops.tree_attention import tree_attention
from .attention import forward as model_forward
from .attention import stack_hidden
from .families import layer_types

# model_type -> (causal LM class, decoder layer class, attention class, MLP class, RMSNorm class) names.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "mistral": ("MistralForCausalLM", "MistralDecoderLayer", "MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
}
QK_NORM = frozenset({"qwen3"})  # families that RMS-normalise each query and key head before the rotation


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(m, name, None) for m in module.modules()
               for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def unsupported_reason(model) -> Optional[str]:
    """Why `LeanForward` does not take `model` (None: it does)."""
    if not config.lean_forward:
        return "config.lean_forward is off"
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} (takes {sorted(FAMILIES)})"
    lm_cls, layer_cls, attn_cls, mlp_cls, norm_cls = FAMILIES[model_type]
    if type(model).__name__ != lm_cls:
        return f"{type(model).__name__} is not {lm_cls}"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        return "not on a CPU"
    if getattr(model, "tp_size", None) not in (None, 1) or getattr(cfg, "pretraining_tp", 1) != 1:
        return "tensor parallel"
    if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return "not a SiLU MLP without biases"
    types = layer_types(cfg)
    if any(t != "full_attention" for t in types):
        return "layers other than full attention (sliding windows)"
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return "post-processed logits"
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []))[: cfg.num_hidden_layers]
    if len(layers) != cfg.num_hidden_layers or any(type(layer).__name__ != layer_cls for layer in layers):
        return f"decoder layers are not all {layer_cls}"
    for layer in layers:
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if model_type in QK_NORM:
            norms += [getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)]
        if (type(layer.self_attn).__name__ != attn_cls or type(layer.mlp).__name__ != mlp_cls
                or any(type(norm).__name__ != norm_cls for norm in norms)):
            return "a layer's attention, MLP or norms are not transformers' own"
        linears = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a projection is not a torch.nn.Linear (quantized or sharded)"
    if type(inner.norm).__name__ != norm_cls or type(model.lm_head) is not torch.nn.Linear:
        return "the final norm or the LM head is not transformers' own"
    if _has_hooks(model) or _global_hooks():
        return "forward hooks are registered"
    # The modules whose forward this one replaces must run their class's forward: one with its
    # own (accelerate's offloading hooks swap it in, `_hf_hook`) would be bypassed. The linears,
    # the embedding and the rotary module are called through their own forward, whatever it is.
    replaced = [model, inner, inner.norm]
    for layer in layers:
        replaced += [layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm,
                     getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)]
    if any(m is not None and ("forward" in m.__dict__ or hasattr(m, "_hf_hook")) for m in replaced):
        return "a module's forward is replaced (accelerate hooks, offloading)"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, element for element the same in
    # the [B, T, H, D] layout as in transformers' [B, H, T, D] one.
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


class LeanForward:
    """`hf.forward` for tree steps of one model (see the module docstring); build with `for_model`."""

    def __init__(self, model):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.layers = list(self.inner.layers)[: cfg.num_hidden_layers]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.qk_norm = cfg.model_type in QK_NORM

    @classmethod
    def for_model(cls, model) -> Optional["LeanForward"]:
        """A `LeanForward` for `model`, or None where it does not apply (`unsupported_reason`)."""
        return cls(model) if unsupported_reason(model) is None else None

    def forward(self, model, cache, tokens, position_ids, tree_mask=None, logits_to_keep=0, return_hidden=False):
        """`hf.forward(model, cache, tokens, position_ids, tree_mask, logits_to_keep, return_hidden)`
        with the same results; a prefill (no tree mask) runs `hf.forward` itself."""
        if tree_mask is None or model is not self.model:
            return model_forward(model, cache, tokens, position_ids, tree_mask, logits_to_keep, return_hidden)
        block_table = cache.attention_block_table()
        batch, num_tokens = tokens.shape
        h = self.inner.embed_tokens.forward(tokens.clamp(min=0))
        cos, sin = self.inner.rotary_emb(h, position_ids=position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]: queries and keys stay [B, T, H, D]
        layers_wanted = return_hidden not in (False, True)
        states: List[torch.Tensor] = [h] if layers_wanted else []
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm.forward(h)
            q = attn.q_proj.forward(x).view(batch, num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj.forward(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            v = attn.v_proj.forward(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
            keys, values = cache.layers[index].update(k.transpose(1, 2), v.transpose(1, 2))
            out = tree_attention(q, keys.transpose(1, 2), values.transpose(1, 2), tree_mask, cache.seqlens,
                                 block_table=block_table, scale=attn.scaling)
            h = h + attn.o_proj.forward(out.reshape(batch, num_tokens, -1))
            x = layer.post_attention_layernorm.forward(h)
            h = h + mlp.down_proj.forward(F.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
            if layers_wanted and index + 1 < len(self.layers):
                states.append(h)
        h = self.inner.norm.forward(h)
        kept = h if logits_to_keep == 0 else h[:, -logits_to_keep:]
        logits = self.model.lm_head.forward(kept).float()
        if return_hidden is False:
            return logits
        if return_hidden is True:
            return logits, h
        states.append(h)
        return logits, stack_hidden(model, states, return_hidden)


def tree_step_forward(model):
    """The forward `generate` runs `model`'s tree steps with (`hf.forward`'s signature): a
    `LeanForward`'s where it applies, else `hf.forward` itself. Decide once per call: the
    check walks every module (~4 ms on the default model)."""
    lean = LeanForward.for_model(model)
    return model_forward if lean is None else lean.forward
