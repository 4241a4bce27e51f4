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

At the row counts where `generate` runs the target's linears through `small_linear`, on a
dense cache, each layer is instead one `torch.ops.specdec.decoder_layer` call
(`ops/decoder_layer.py`): no Python and no torch dispatch between a layer's steps (the
default model's fp32 step 36.5 -> 25.9 ms at 2 threads). Its element-wise steps round where
transformers' do, so it differs from the op-by-op path only in the order of RMSNorm's sum of
squares (`config.fused_layers = False` or SPECDEC_FUSED_LAYERS=0 turns it off).

The prefill takes the same ops where they pay (`LeanForward.prefill`): each row's prompt in
equal chunks of at most `linear_rows[1]` tokens (the most rows at which `small_linear`
measured faster than torch's BLAS), or of up to `PREFILL_BLAS_CHUNK` tokens on BLAS where BLAS
won at more rows (`prefill_chunk`), each chunk one step whose "tree" is a causal chain (which tree attention
recognises: it computes the chunk's triangle of queries and keys, not the square). Its
products then run where they are fastest and its element-wise steps without transformers'
per-op overhead: on the default model here (2 cores, one row at a time, interleaved in one
process) prompts of 240-692 tokens prefilled 1.11-1.22x faster than transformers' forward on
MKL in fp32 (chunks of 128), 1.08-1.37x in bf16 (chunks of up to 512). It equals `hf.prefill`
to fp32 rounding (another summation order in the products), not bit for bit.
"""

from typing import List, Optional

import torch
import torch.nn.functional as F

from ... import config
from ...ops import decoder_layer as fused
from ...ops import small_linear as linear
from ...ops.reference.decoder_layer import rotate
from ...ops.tree_attention import tree_attention
from ...ops.tree import pack_tree_mask
from .attention import forward as model_forward
from .attention import prefill as model_prefill
from .attention import stack_hidden
from .families import layer_types
from ..memory import huge_page_buffer

# model_type -> (causal LM class, decoder layer class, attention class, MLP class, RMSNorm class) names.
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "mistral": ("MistralForCausalLM", "MistralDecoderLayer", "MistralAttention", "MistralMLP", "MistralRMSNorm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),
}
QK_NORM = frozenset({"qwen3"})  # families that RMS-normalise each query and key head before the rotation
# The prefill runs through the fused layers only where `small_linear` measured faster than
# torch's BLAS up to at least this many rows: smaller chunks would leave the products short of
# the FMA peak that BLAS reaches on a whole prompt.
PREFILL_MIN_CHUNK = 64
# Where torch's BLAS won past `linear_rows[1]` rows (`prefill_chunk`), the most tokens of a
# chunk: BLAS gains with the rows. bf16 on the 2-core AMD EPYC (Zen 4), in one process,
# interleaved, prompts of 240-692 tokens: chunks of at most 128 / 200 / 512 / 1024 tokens took
# 1.04-1.32 / 1.0-1.21 / 0.94-1.02 / 0.93-1.09 of the time chunks of 320 did.
PREFILL_BLAS_CHUNK = 512
# Greedy steps of up to this many rows (B x T), per LM-head dtype, take each node's token from
# `small_linear_argmax` (one byte per weight of the LM head, then the candidates' exact logits)
# instead of the full logits. The default model's LM head (49152 x 576) on the 2-thread AMD
# EPYC (Zen 4, AVX-512), against `small_linear` and the argmax, medians of 15, three runs (the
# harness calls the head back to back, so its int8 copy, 28 MB, is partly in L3 there):
# fp32 1 row 0.8-1.2 ms against 3.2-3.8, 3 rows 1.3-1.6 / 4.9, 5 rows 1.8-3.2 / 5.0-5.3, 8 rows
# 3.5-4.2 / 5.2-6.6; bf16 1 row 0.8-0.9 / 1.5-2.1, 3 rows 1.2-2.0 / 1.8-2.1, 5 rows 1.9-2.6 /
# 3.0-3.4, 7 rows 2.9-3.2 / 3.2-3.6, 8 rows 3.3-4.2 / 3.4-3.7 (from ~8 rows the int8 pass is
# bound by its arithmetic; bf16 products are cheaper to compute in full than fp32 ones).
ARGMAX_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 7}


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
    lm_cls, layer_cls, _, _, norm_cls = FAMILIES[model_type]
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
        reason = _layer_reason(layer, model_type)
        if reason is not None:
            return reason
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


def _layer_reason(layer, model_type: str) -> Optional[str]:
    """Why a decoder layer of family `model_type` is not one the lean forward computes: its
    attention, MLP or norms are not the family's own classes, or a projection is not a plain
    linear (None: it is)."""
    _, _, attn_cls, mlp_cls, norm_cls = FAMILIES[model_type]
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
    return None


def fused_layer(layer, cfg) -> Optional[tuple]:
    """(weights, eps) to run `layer`, one decoder layer of a model whose config is `cfg`, as one
    `decoder_layer` op (a learned head's block built from the target's layer class: heads.mtp),
    or None where it is not exactly a Llama / Mistral / Qwen2 / Qwen3 layer the op computes
    (transformers' own attention, SiLU MLP without biases and RMSNorms; full attention; plain
    linears; fp32 or bf16 contiguous weights; one epsilon)."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES or getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
        return None
    if type(layer).__name__ != FAMILIES[model_type][1] or _layer_reason(layer, model_type) is not None:
        return None
    if getattr(layer.self_attn, "sliding_window", None) or _has_hooks(layer):
        return None
    weights, eps = _layer_weights(layer), _norm_eps(layer)
    return None if weights is None or eps is None else (weights, eps)


def _layer_weights(layer) -> Optional[List[Optional[torch.Tensor]]]:
    """`layer`'s parameters in `decoder_layer.WEIGHT_NAMES` order, or None where the fused op
    cannot take them (dtypes other than the layer's fp32/bf16, non-contiguous weights)."""
    attn, mlp = layer.self_attn, layer.mlp
    weights = [layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
               attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias,
               getattr(getattr(attn, "q_norm", None), "weight", None), getattr(getattr(attn, "k_norm", None), "weight", None),
               attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
               mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    dtype = attn.q_proj.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(w is not None and (w.dtype != dtype or not w.is_contiguous()) for w in weights):
        return None
    return [None if w is None else w.detach() for w in weights]


def _norm_eps(layer) -> Optional[float]:
    """The one epsilon of `layer`'s RMSNorms, or None if they differ."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm, getattr(layer.self_attn, "q_norm", None),
             getattr(layer.self_attn, "k_norm", None)]
    eps = {float(norm.variance_epsilon) for norm in norms if norm is not None}
    return eps.pop() if len(eps) == 1 else None


class LeanForward:
    """`hf.forward` for tree steps of one model (see the module docstring); build with `for_model`.

    `linear_rows` (lo, hi): the row counts (B x T) at which `generate` routes the target's
    linears to `small_linear` (the cost model's choice). Steps of lo rows or more on a dense
    cache run each layer as one `decoder_layer` op (C++: the same steps without the Python
    between them; equal to this forward with those linears routed up to the order of
    RMSNorm's sum of squares), its products on torch's BLAS past hi rows (`blas_rows`); other
    steps run the layers op by op here."""

    def __init__(self, model, linear_rows=(0, 0)):
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.layers = list(self.inner.layers)[: cfg.num_hidden_layers]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.qk_norm = cfg.model_type in QK_NORM
        self.linear_rows = tuple(int(r) for r in linear_rows)
        self._chain_masks = {}  # (nodes, device) -> the packed mask of a causal chain (the prefill's chunks)
        # The fused layers' parameters, when every layer qualifies (see _layer_weights).
        self.fused_layers = None
        if config.fused_layers and self.linear_rows[0] >= 1 and fused.has_kernel():
            weights = [_layer_weights(layer) for layer in self.layers]
            eps = [_norm_eps(layer) for layer in self.layers]
            if all(w is not None for w in weights) and all(e is not None for e in eps):
                # (each layer's attention scale read here: a module attribute costs ~2.5 us a read)
                self.fused_layers = [(w, e, layer.self_attn.scaling) for w, e, layer in zip(weights, eps, self.layers)]

    @classmethod
    def for_model(cls, model, linear_rows=(0, 0)) -> Optional["LeanForward"]:
        """A `LeanForward` for `model`, or None where it does not apply (`unsupported_reason`)."""
        return cls(model, linear_rows) if unsupported_reason(model) is None else None

    def fuses(self, rows: int, cache) -> bool:
        """Whether a step of `rows` rows (B x T) on `cache` runs the fused `decoder_layer` op."""
        return self.fused_layers is not None and self.linear_rows[0] <= rows and cache.block_table is None

    def greedy_rows(self, rows: int) -> bool:
        """Whether a greedy step of `rows` rows (B x T) may take each node's token from
        `small_linear_argmax` (`forward(..., greedy=True)`): `config.argmax_head`, an fp32 or
        bf16 CPU LM head without a bias, its product routed to `small_linear` at this row count
        (so the tokens are the argmax of exactly the logits the step would compute), and at most
        ARGMAX_MAX_ROWS[its dtype] rows. The int8 copy of the head and its bounds are made on the first
        call (kept on the head module until its weight changes)."""
        return self._argmax_head(rows) is not None

    def prepare_greedy(self) -> None:
        """Make the int8 copy of the LM head and its bounds (`greedy_rows`) now, where they
        apply: the first greedy step would otherwise pay for them (~0.4 s for the default
        model), and the adaptive planner would take that for what a plain step costs (one
        such step once left its plain-step estimate 1.5x too high for the rest of the process)."""
        self._argmax_weights()

    def _argmax_head(self, rows: int):
        """`_argmax_weights()` for a greedy step of `rows` rows, or None where `greedy_rows` does not hold."""
        lo, hi = self.linear_rows
        most = ARGMAX_MAX_ROWS.get(self.model.lm_head.weight.dtype, 0)
        return self._argmax_weights() if lo <= rows <= min(hi, most) else None

    def _argmax_weights(self):
        """(weight, weight_int8, row_stats) of the LM head for `small_linear_argmax`, or None."""
        head = self.model.lm_head
        weight = head.weight
        if (not config.argmax_head or head.bias is not None or weight.dtype not in linear.DTYPES
                or weight.device.type != "cpu" or not hasattr(torch.ops.specdec, "small_linear_argmax")):
            return None
        # (an inference tensor has no version counter, and cannot change outside inference mode)
        key = (weight.data_ptr(), None if weight.is_inference() else weight._version, tuple(weight.shape))
        kept = head.__dict__.get("_specdec_argmax_weights")
        if kept is None or kept[0] != key:
            # The copy in 2 MB pages where the kernel has them (loop/memory.py): a step streams it.
            region = huge_page_buffer(weight.numel())
            out = None if region is None else region.view(torch.int8).view(weight.shape)
            made = linear.argmax_weights(weight.detach(), out=out)
            kept = (key, None if made is None else (weight.detach(),) + made)
            head.__dict__["_specdec_argmax_weights"] = kept
        return kept[1]

    def forward(self, model, cache, tokens, position_ids, tree_mask=None, logits_to_keep=0, return_hidden=False,
                greedy=False):
        """`hf.forward(model, cache, tokens, position_ids, tree_mask, logits_to_keep, return_hidden)`
        with the same results; a prefill (no tree mask) runs `hf.forward` itself. greedy=True
        (a tree step where `greedy_rows(B x T)`): each node's greedy token, int64 [B, T]
        (`sampling.greedy_tokens` of the logits, bit for bit), in place of the logits."""
        head = self._argmax_head(tokens.numel()) if greedy else None
        if greedy and (tree_mask is None or model is not self.model or head is None or logits_to_keep != 0):
            raise ValueError("LeanForward.forward: greedy=True needs a tree step of this model at a row count "
                             "where greedy_rows() holds, and every node's logits")
        if tree_mask is None or model is not self.model:
            return model_forward(model, cache, tokens, position_ids, tree_mask, logits_to_keep, return_hidden)
        block_table = cache.attention_block_table()
        batch, num_tokens = tokens.shape
        h = self.inner.embed_tokens.forward(tokens.clamp(min=0))
        cos, sin = self.inner.rotary_emb(h, position_ids=position_ids)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]: queries and keys stay [B, T, H, D]
        layers_wanted = return_hidden not in (False, True)
        states: List[torch.Tensor] = [h] if layers_wanted else []
        if self.fuses(batch * num_tokens, cache):
            h = self._fused_layers(h, cos.squeeze(2), sin.squeeze(2), cache, tree_mask, states if layers_wanted else None)
            return self._finish(model, h, states, logits_to_keep, return_hidden, head)
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm.forward(h)
            q = attn.q_proj.forward(x).view(batch, num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj.forward(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            v = attn.v_proj.forward(x).view(batch, num_tokens, self.num_kv_heads, self.head_dim)
            keys, values = cache.layers[index].update(k.transpose(1, 2), v.transpose(1, 2))
            out = tree_attention(q, keys.transpose(1, 2), values.transpose(1, 2), tree_mask, cache.seqlens,
                                 block_table=block_table, scale=attn.scaling)
            h = h + attn.o_proj.forward(out.reshape(batch, num_tokens, -1))
            x = layer.post_attention_layernorm.forward(h)
            h = h + mlp.down_proj.forward(F.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
            if layers_wanted and index + 1 < len(self.layers):
                states.append(h)
        return self._finish(model, h, states, logits_to_keep, return_hidden, head)

    def _fused_layers(self, h, cos, sin, cache, tree_mask, states=None):
        """Every layer as one `decoder_layer` op over `h [B, T, hidden]` (cos / sin [B, T, D]);
        each layer's output but the last appended to `states` when given."""
        # The op's overload itself (not the packet, which resolves it per call), the loop's
        # invariants out of the loop: this loop is the host time of a one-token step's layers.
        layer_op, seqlens, blas_rows, last = torch.ops.specdec.decoder_layer.default, cache.seqlens, \
            self.linear_rows[1] + 1, len(self.fused_layers) - 1
        for index, (weights, eps, scale) in enumerate(self.fused_layers):
            cache_layer = cache.layers[index]
            h = layer_op(h, cos, sin, weights, cache_layer.k_buf, cache_layer.v_buf, tree_mask, seqlens, scale, eps,
                         blas_rows)
            if states is not None and index < last:
                states.append(h)
        return h

    def prefill_chunk(self, cache) -> int:
        """The most tokens a prefill chunk of one row runs on `cache` through the fused layers,
        or 0 where the prefill runs `hf.prefill` instead: no fused layers, a paged cache, or
        our kernel faster than BLAS only below `PREFILL_MIN_CHUNK` rows. Where our kernel
        measured faster at every row count compared (`small_linear.LAYOUT_ROWS`), chunks of
        `linear_rows[1]` tokens (its products on our kernel); where torch's BLAS won past
        `linear_rows[1]` rows, chunks of up to `PREFILL_BLAS_CHUNK` tokens, their products on
        BLAS (`blas_rows`), which gains with the rows: bf16 on the 2-core AMD EPYC (Zen 4), rows
        of 150-285 tokens 5-20% faster than in chunks of 64 on our kernel (interleaved, five
        rounds; docs/loop.md, twenty-second session)."""
        chunk = self.linear_rows[1]
        if chunk < PREFILL_MIN_CHUNK or not self.fuses(chunk, cache):
            return 0
        return chunk if chunk >= max(linear.LAYOUT_ROWS) else PREFILL_BLAS_CHUNK

    def prefill(self, model, cache, history: torch.Tensor, lengths: torch.Tensor, return_hidden=False):
        """`hf.prefill(model, cache, history, lengths, return_hidden)`: the same arguments and
        results (to fp32 rounding), one row at a time (no padding is computed), each row's
        tokens but its last run through the fused layers in equal chunks of at most
        `prefill_chunk(cache)` tokens. `hf.prefill` itself where the chunk is 0 or `model` is
        another model."""
        chunk = self.prefill_chunk(cache)
        if chunk == 0 or model is not self.model:
            return model_prefill(model, cache, history, lengths, return_hidden)
        prefix = lengths.long() - 1
        sizes = prefix.tolist()  # (one read from the device)
        layers_wanted = return_hidden not in (False, True)
        parts = [self._prefill_row(cache.row(b), history[b: b + 1], n, chunk, return_hidden) for b, n in enumerate(sizes)]
        cache.set_lengths(prefix)
        if not return_hidden:
            return None
        hidden = torch.zeros((len(sizes), max(sizes)) + ((len(return_hidden),) if layers_wanted else ())
                             + (self.model.config.hidden_size,), dtype=self.inner.norm.weight.dtype,
                             device=history.device)
        for b, part in enumerate(parts):
            if part is not None:
                hidden[b, : part.shape[1]] = part[0]
        return hidden

    def _prefill_row(self, cache, tokens, num, chunk, return_hidden):
        """One row's prefill over `tokens[:, :num]` through `cache` (a one-row cache), in
        ceil(num / chunk) chunks of equal size (a short last chunk would read every weight for
        a few rows); the hidden states `prefill` asks for, [1, num, ...], or None."""
        if num <= 0:
            return None
        size = -(-num // -(-num // chunk))
        layers_wanted = return_hidden not in (False, True)
        parts = []
        for start in range(0, num, size):
            count = min(size, num - start)
            cache.set_lengths(torch.tensor([start]), max_len=start)
            positions = torch.arange(start, start + count, device=tokens.device)[None]
            h = self.inner.embed_tokens.forward(tokens[:, start: start + count])
            cos, sin = self.inner.rotary_emb(h, position_ids=positions)
            states = [h] if layers_wanted else None
            h = self._fused_layers(h, cos, sin, cache, self._chain_mask(count, tokens.device), states)
            h = self.inner.norm.forward(h)
            if layers_wanted:
                states.append(h)
                parts.append(stack_hidden(self.model, states, return_hidden))
            elif return_hidden:
                parts.append(h)
        return torch.cat(parts, 1) if parts else None

    def _chain_mask(self, count: int, device) -> torch.Tensor:
        """The packed tree mask of a causal chain of `count` nodes (node i sees nodes 0 .. i), kept per size."""
        if (count, device) not in self._chain_masks:
            self._chain_masks[(count, device)] = pack_tree_mask(
                torch.ones(count, count, dtype=torch.bool, device=device).tril())
        return self._chain_masks[(count, device)]

    def _finish(self, model, h, states, logits_to_keep, return_hidden, argmax_head=None):
        # The final norm and the LM head (with `argmax_head`, `_argmax_weights()`: each node's
        # greedy token instead), and the hidden states asked for.
        h = self.inner.norm.forward(h)
        kept = h if logits_to_keep == 0 else h[:, -logits_to_keep:]
        logits = self.model.lm_head.forward(kept).float() if argmax_head is None else \
            linear.small_linear_argmax(kept, *argmax_head)
        if return_hidden is False:
            return logits
        if return_hidden is True:
            return logits, h
        states.append(h)
        return logits, stack_hidden(model, states, return_hidden)


def step_functions(model, linear_rows=(0, 0)):
    """(tree forward, prefill, lean) that `generate` runs `model` with (`hf.forward`'s and
    `hf.prefill`'s signatures): a `LeanForward`'s where it applies (and that `LeanForward`, for
    its greedy steps: `greedy_rows`), else `hf.forward`, `hf.prefill` and None; `linear_rows`:
    the row counts at which the target's linears run `small_linear` (`LeanForward`). Decide
    once per call: the check walks every module (~4 ms on the default model)."""
    lean = LeanForward.for_model(model, linear_rows)
    return (model_forward, model_prefill, None) if lean is None else (lean.forward, lean.prefill, lean)


def tree_step_forward(model, linear_rows=(0, 0)):
    """The tree forward of `step_functions(model, linear_rows)`."""
    return step_functions(model, linear_rows)[0]
