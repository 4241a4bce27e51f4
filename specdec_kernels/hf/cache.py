"""`TreeKVCache`: a preallocated, ragged KV cache that transformers models write into.

Layout: one key and one value buffer per layer, `[B, S, Hkv, D]`, and per-row lengths
`seqlens int32 [B]`. Rows are left-aligned: token t of row b (its t-th real token, prompt
padding removed) lives in slot t, so positions equal slot indices and there is never a
padding hole inside a row; slots past `seqlens[b]` are scratch.

Every forward through the model writes its T new keys/values at `seqlens[b] + j` (`j < T`)
of each row: a prefill at seqlens = 0, a token tree after the prefix, a ragged chain of
pending tokens. Nothing is concatenated: after verification `compact_` moves the accepted
path next to the prefix with `compact_kv_cache_` and the lengths grow by the accepted count.

It plugs into transformers 5.x as `past_key_values=` (a `transformers.cache_utils.Cache`
whose layers implement the `CacheLayerMixin` interface); `update` hands the attention
function `[B, H, S', D]` views of the buffers (`S' = max(seqlens) + T`, no copy), which our
attention transposes back to `[B, S', H, D]` for `tree_attention`.
"""

from typing import List

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kv_cache import compact_kv_cache_


class _TreeKVLayer(CacheLayerMixin):
    """One layer's buffers; the lengths live in the owning `TreeKVCache`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "TreeKVCache", keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.k_buf, self.v_buf = keys, values  # [B, S, H, D]
        self.keys, self.values = keys.transpose(1, 2), values.transpose(1, 2)  # HF's [B, H, S, D] view
        self.is_initialized = True
        self.device, self.dtype = keys.device, keys.dtype

    def lazy_initialization(self, *args, **kwargs) -> None:  # preallocated: nothing to do
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write [B, H, T, D] states at slots seqlens[b] + j; return [B, H, max_len + T, D] views."""
        return self.owner._write(self, key_states, value_states)

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.owner.get_mask_sizes(query_length)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.owner.max_len

    def get_max_length(self) -> int:
        return self.k_buf.shape[1]

    get_max_cache_shape = get_max_length  # (the name in earlier transformers releases)

    def reset(self) -> None:
        self.owner.seqlens.zero_()
        self.owner.max_len = 0


class TreeKVCache(Cache):
    """Preallocated per-layer `[B, S, H, D]` keys/values with per-row lengths (see module docstring).

    Args:
        num_layers, batch_size, capacity (S), num_kv_heads, head_dim, dtype, device: the buffers.

    Attributes:
        seqlens: int32 [B], tokens held per row (slots 0 .. seqlens[b]-1 are valid).
        max_len: int, max(seqlens) kept on the host (sizes the views handed to attention).
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int, dtype, device):
        layers = []
        for _ in range(num_layers):
            k = torch.zeros(batch_size, capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
            layers.append(_TreeKVLayer(self, k, torch.zeros_like(k)))
        super().__init__(layers=layers)
        self.capacity = capacity
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.max_len = 0
        self._rows = torch.arange(batch_size, device=device)[:, None]

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int) -> "TreeKVCache":
        """A cache shaped for `model` (a transformers causal LM), in its dtype and on its device."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        # Under transformers' tensor parallelism (tp_plan="auto") each rank computes only its
        # share of the heads (k/v projections split by columns), so its cache holds only those.
        tp_size = getattr(model, "tp_size", None) or 1
        if tp_size > 1 and num_kv_heads % tp_size == 0:
            num_kv_heads //= tp_size
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        param = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, capacity, num_kv_heads, head_dim, param.dtype, param.device)

    def buffers(self) -> List[torch.Tensor]:
        """All layers' key and value buffers, [B, S, H, D] each (what `compact_kv_cache_` takes)."""
        return [buf for layer in self.layers for buf in (layer.k_buf, layer.v_buf)]

    def _write(self, layer: _TreeKVLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        num_new = key_states.shape[2]
        end = self.max_len + num_new
        if end > self.capacity:
            raise ValueError(f"TreeKVCache: {end} slots needed but the cache holds {self.capacity}")
        slots = self.seqlens.to(torch.int64)[:, None] + torch.arange(num_new, device=self.seqlens.device)
        layer.k_buf[self._rows, slots] = key_states.transpose(1, 2).to(layer.dtype)
        layer.v_buf[self._rows, slots] = value_states.transpose(1, 2).to(layer.dtype)
        return layer.keys[:, :, :end], layer.values[:, :, :end]

    def set_lengths(self, seqlens: torch.Tensor) -> None:
        """Set the per-row lengths (e.g. after a prefill, or to drop scratch entries)."""
        self.seqlens = seqlens.to(device=self.seqlens.device, dtype=torch.int32).contiguous()
        self.max_len = int(self.seqlens.max())

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (int64 indices, in the new order): every layer's buffers
        are copied once, so later forwards run on the smaller batch (rows that finished early
        stop costing compute)."""
        for layer in self.layers:
            layer.k_buf, layer.v_buf = layer.k_buf[rows], layer.v_buf[rows]
            layer.keys, layer.values = layer.k_buf.transpose(1, 2), layer.v_buf.transpose(1, 2)
        self._rows = torch.arange(rows.numel(), device=self.seqlens.device)[:, None]
        self.set_lengths(self.seqlens[rows])

    def compact_(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep a verified tree's accepted path (root first) right after each row's prefix.

        The tree was written at seqlens[b] + node; afterwards the lengths grow by
        num_accepted + 1 (`compact_kv_cache_`, one call for all layers).
        """
        self.set_lengths(compact_kv_cache_(self.buffers(), self.seqlens, accepted_nodes, num_accepted))

    def accept(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, counts: torch.Tensor) -> None:
        """After a verify step whose rows emitted `counts [B]` tokens: keep what the rows kept.

        The invariant of the decoding loop: a row's cache holds every token of the row but the
        last (the next tree's root). A step emits the accepted drafts plus one token, so the
        root and the first counts[b] - 1 accepted drafts enter the cache: the accepted path is
        compacted after the prefix, and the lengths grow by counts[b] (not num_accepted + 1:
        a row cut short by eos or its token budget, or a finished row with counts 0, keeps
        only what it emitted).
        """
        prefix = self.seqlens
        compact_kv_cache_(self.buffers(), prefix, accepted_nodes, num_accepted)
        self.set_lengths(prefix + counts.to(prefix.dtype))

    # transformers' Cache API (what models and mask builders may ask)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """max(seqlens): rows are ragged, so this is only an upper bound for each row."""
        return self.max_len

    def get_mask_sizes(self, query_length, layer_idx: int = 0, *args, **kwargs):
        # (older transformers 5.x pass cache_position, a tensor of the new positions)
        """(kv_length, kv_offset) of the views `update` returns: (max(seqlens) + new tokens, 0)."""
        num_new = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.max_len + num_new, 0

    def get_max_length(self, *args, **kwargs) -> int:
        """The preallocated length S."""
        return self.capacity

    get_max_cache_shape = get_max_length  # (the name in earlier transformers releases)
