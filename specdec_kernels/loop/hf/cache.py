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

Keys and values of a layer may differ in heads and head dim, and layers may differ from each
other: DeepSeek-V2/V3 (MLA) as transformers 5 runs them cache the compressed latents (one
"head" of kv_lora_rank as the key, the shared rotary key of qk_rope_head_dim as the value) and
expand them after reading; older releases cached the expanded keys (qk_nope + qk_rope) and
values (v_head_dim). The buffers are sized from the config where it says, and a layer whose
first write brings other shapes (while the cache is still empty) is reallocated to them.

Paged (`page_size=N`): each layer holds a page pool `[num_pages, N, Hkv, D]` for keys and one
for values, and all layers share one `block_table int32 [B, P]` (P = ceil(capacity / N)):
token t of row b lives at `[block_table[b, t // N], t % N]`, the layout of vLLM / FlashInfer
and of `tree_attention(..., block_table=)` / `compact_kv_cache_(..., block_table=)`. Writes
scatter through the block table; tree steps hand attention the whole pools (HF's
`[num_pages, H, N, D]` view) and the block table (`attention_block_table`, passed as a forward
kwarg by `hf.forward`). A forward on an empty cache (the prefill: every row at seqlens 0)
gets back just the new states, which are the whole context, so it runs plain causal SDPA
without gathering pages. Pages are dealt to rows interleaved and in reverse order (row b's
page p is `num_pages - 1 - (p * B + b)`), so no row's pages are contiguous or ascending.
"""

from typing import List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...ops.kv_cache import compact_kv_cache_


class _TreeKVLayer(CacheLayerMixin):
    """One layer's buffers; the lengths live in the owning `TreeKVCache`."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "TreeKVCache", keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.k_buf, self.v_buf = keys, values  # [B, S, H, D] (paged: pools [num_pages, page_size, H, D])
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
        return self.owner.capacity

    get_max_cache_shape = get_max_length  # (the name in earlier transformers releases)

    def reset(self) -> None:
        self.owner.seqlens.zero_()
        self.owner.max_len = 0


def check_page_size(page_size, name: str = "page_size") -> None:
    """ValueError naming `name` unless `page_size` is None (dense) or an int >= 1."""
    if page_size is None:
        return
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"{name}: expected None (a dense cache) or an int >= 1 (slots per page), got {page_size!r}")


class TreeKVCache(Cache):
    """Preallocated per-layer keys/values with per-row lengths, dense `[B, S, H, D]` or paged
    (see the module docstring).

    Args:
        num_layers, batch_size, capacity (S, tokens per row), num_kv_heads, head_dim, dtype,
            device: the buffers.
        page_size: None for dense buffers; N >= 1 for page pools of N slots per page, addressed
            through `block_table`.

    Attributes:
        seqlens: int32 [B], tokens held per row (slots 0 .. seqlens[b]-1 are valid).
        max_len: int, max(seqlens) kept on the host (sizes the views handed to attention).
        page_size: None (dense) or the slots per page.
        block_table: None (dense) or int32 [B, ceil(capacity / page_size)], row b's pages in order.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int, dtype, device,
                 page_size: Optional[int] = None, value_head_dim: Optional[int] = None,
                 value_heads: Optional[int] = None):
        check_page_size(page_size)
        self.page_size = page_size
        self.block_table = None
        if page_size is None:
            self._slots = (batch_size, capacity)
        else:
            pages_per_row = -(-capacity // page_size)
            num_pages = batch_size * pages_per_row
            # Interleaved between rows and in reverse, so that the block table's indirection is
            # real: a kernel that ignored it (or assumed ascending pages) would read wrong slots.
            page = torch.arange(pages_per_row, device=device)[None, :] * batch_size + torch.arange(batch_size, device=device)[:, None]
            self.block_table = (num_pages - 1 - page).to(torch.int32)
            self._slots = (num_pages, page_size)
        value_shape = (value_heads or num_kv_heads, value_head_dim or head_dim)
        layers = []
        for _ in range(num_layers):
            k = torch.zeros(self._slots + (num_kv_heads, head_dim), dtype=dtype, device=device)
            layers.append(_TreeKVLayer(self, k, torch.zeros(self._slots + value_shape, dtype=dtype, device=device)))
        super().__init__(layers=layers)
        self.capacity = capacity
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.max_len = 0
        self._rows = torch.arange(batch_size, device=device)[:, None]

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int, page_size: Optional[int] = None) -> "TreeKVCache":
        """A cache shaped for `model` (a transformers causal LM), in its dtype and on its device;
        `page_size`: None (dense) or slots per page (paged).

        Raises NotImplementedError, naming the family and why, for models the loop cannot run
        (`families.check_supported`: recurrent layers, attention outside transformers'
        attention interface), before any forward."""
        from .families import check_supported

        check_supported(model)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        num_heads = cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        # Under transformers' tensor parallelism (tp_plan="auto") each rank computes only its
        # share of the heads (k/v projections split by columns), so its cache holds only those.
        tp_size = getattr(model, "tp_size", None) or 1
        if tp_size > 1 and num_kv_heads % tp_size == 0:
            num_kv_heads //= tp_size
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        value_dim = value_heads = None
        if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
            # MLA (DeepSeek-V2/V3): transformers 5 caches the latents, one head each (a layer
            # whose first write differs is reallocated, see `_write`).
            num_kv_heads, head_dim, value_heads, value_dim = 1, cfg.kv_lora_rank, 1, cfg.qk_rope_head_dim
        param = next(model.parameters())
        return cls(cfg.num_hidden_layers, batch_size, capacity, num_kv_heads, head_dim, param.dtype, param.device,
                   page_size=page_size, value_head_dim=value_dim, value_heads=value_heads)

    def buffers(self) -> List[torch.Tensor]:
        """All layers' key and value buffers (what `compact_kv_cache_` takes): [B, S, H, D]
        each, or paged the pools [num_pages, page_size, H, D]."""
        return [buf for layer in self.layers for buf in (layer.k_buf, layer.v_buf)]

    def attention_block_table(self) -> Optional[torch.Tensor]:
        """The block table attention must read the pools through in the next forward: None for
        a dense cache, and for an empty paged one (its forward gets the new states themselves,
        see `_write`)."""
        return None if self.block_table is None or self.max_len == 0 else self.block_table

    def _reshape_layer(self, layer: _TreeKVLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Give `layer` buffers of the [H, D] the model writes (keys and values each), if they
        differ from what the config suggested; only while the cache holds nothing."""
        want_k = (key_states.shape[1], key_states.shape[3])
        want_v = (value_states.shape[1], value_states.shape[3])
        if tuple(layer.k_buf.shape[2:]) == want_k and tuple(layer.v_buf.shape[2:]) == want_v:
            return
        if self.max_len != 0:
            raise ValueError(f"TreeKVCache: a layer wrote keys [H, D] = {list(want_k)} and values {list(want_v)} into "
                             f"buffers of {list(layer.k_buf.shape[2:])} / {list(layer.v_buf.shape[2:])} that already "
                             "hold tokens (a layer's shapes must not change between forwards)")
        layer.k_buf = torch.zeros(self._slots + want_k, dtype=layer.dtype, device=layer.device)
        layer.v_buf = torch.zeros(self._slots + want_v, dtype=layer.dtype, device=layer.device)
        layer.keys, layer.values = layer.k_buf.transpose(1, 2), layer.v_buf.transpose(1, 2)

    def _write(self, layer: _TreeKVLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        self._reshape_layer(layer, key_states, value_states)
        num_new = key_states.shape[2]
        end = self.max_len + num_new
        if end > self.capacity:
            raise ValueError(f"TreeKVCache: {end} slots needed but the cache holds {self.capacity}")
        slots = self.seqlens.to(torch.int64)[:, None] + torch.arange(num_new, device=self.seqlens.device)
        keys, values = key_states.transpose(1, 2).to(layer.dtype), value_states.transpose(1, 2).to(layer.dtype)
        if self.block_table is None:
            layer.k_buf[self._rows, slots] = keys
            layer.v_buf[self._rows, slots] = values
            return layer.keys[:, :, :end], layer.values[:, :, :end]
        # Paged: slot t of row b is [block_table[b, t // N], t % N], one flat index into the pool.
        pages = self.block_table.gather(1, slots // self.page_size).to(torch.int64)
        flat = (pages * self.page_size + slots % self.page_size).reshape(-1)
        k_pool, v_pool = (-1,) + tuple(layer.k_buf.shape[2:]), (-1,) + tuple(layer.v_buf.shape[2:])
        layer.k_buf.view(k_pool).index_copy_(0, flat, keys.reshape(k_pool))
        layer.v_buf.view(v_pool).index_copy_(0, flat, values.reshape(v_pool))
        if self.max_len == 0:
            # Empty cache: the new states are each row's whole context, so attention needs
            # nothing from the pages (the prefill runs plain causal SDPA on them).
            return keys.transpose(1, 2), values.transpose(1, 2)
        return layer.keys, layer.values  # the pools, [num_pages, H, N, D]: attention reads them via the block table

    def row(self, index: int) -> "TreeKVCache":
        """Row `index` as a cache of one row over the same memory: a forward through it writes
        this cache's row (a prefill without padding: `prefill` runs rows of different lengths
        one at a time). Its lengths start as a copy of the row's; set this cache's lengths
        after writing through it."""
        return _RowView(self, index)

    def set_lengths(self, seqlens: torch.Tensor, max_len: Optional[int] = None) -> None:
        """Set the per-row lengths (e.g. after a prefill, or to drop scratch entries).
        max_len: an upper bound of them known on the host, kept as `max_len` instead of reading
        their maximum back from the device (a host sync on a GPU): views handed to attention
        are then that much longer, and attention reads each row to its own length."""
        self.seqlens = seqlens.to(device=self.seqlens.device, dtype=torch.int32).contiguous()
        self.max_len = int(self.seqlens.max()) if max_len is None else int(max_len)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (int64 indices, in the new order): every layer's buffers
        are copied once, so later forwards run on the smaller batch (rows that finished early
        stop costing compute). Paged: only the block table is re-indexed, no K/V moves; the
        dropped rows' pages stay allocated in the pools, unused (a `generate` call's batch only
        shrinks, so there is nobody to hand them to)."""
        if self.block_table is not None:
            self.block_table = self.block_table[rows].contiguous()
            self.set_lengths(self.seqlens[rows])
            return
        self._slots = (rows.numel(),) + self._slots[1:]
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
        self.set_lengths(compact_kv_cache_(self.buffers(), self.seqlens, accepted_nodes, num_accepted,
                                           block_table=self.block_table))

    def accept(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, counts: torch.Tensor,
               max_count: Optional[int] = None) -> None:
        """After a verify step whose rows emitted `counts [B]` tokens: keep what the rows kept.

        The invariant of the decoding loop: a row's cache holds every token of the row but the
        last (the next tree's root). A step emits the accepted drafts plus one token, so the
        root and the first counts[b] - 1 accepted drafts enter the cache: the accepted path is
        compacted after the prefix, and the lengths grow by counts[b] (not num_accepted + 1:
        a row cut short by eos or its token budget, or a finished row with counts 0, keeps
        only what it emitted).

        max_count: None, or a bound on counts known on the host (the tree's width): `max_len`
        then grows by it, an upper bound until the next exact `set_lengths` (see there).
        """
        prefix = self.seqlens
        compact_kv_cache_(self.buffers(), prefix, accepted_nodes, num_accepted, block_table=self.block_table)
        self.set_lengths(prefix + counts.to(prefix.dtype), None if max_count is None else self.max_len + max_count)

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


class _RowView(TreeKVCache):
    """One row of a `TreeKVCache` (`TreeKVCache.row`): its layers hold the owner's buffers
    narrowed to the row (dense) or the owner's pools with the row's block table (paged), so
    writes land in the owner. A layer whose first write brings other shapes (MLA, see
    `_reshape_layer`) is reshaped in the owner, and the view narrows the new buffers."""

    def __init__(self, owner: TreeKVCache, index: int):
        self.owner, self.index = owner, int(index)
        self.page_size = owner.page_size
        self.block_table = None if owner.block_table is None else owner.block_table[self.index: self.index + 1]
        self._slots = (1,) + tuple(owner._slots[1:]) if owner.block_table is None else owner._slots
        Cache.__init__(self, layers=[_TreeKVLayer(self, *self._narrow(layer)) for layer in owner.layers])
        self.capacity = owner.capacity
        self.seqlens = owner.seqlens[self.index: self.index + 1].clone()
        self.max_len = int(self.seqlens[0])
        self._rows = torch.zeros(1, 1, dtype=torch.long, device=self.seqlens.device)

    def _narrow(self, layer: _TreeKVLayer):
        if self.block_table is not None:
            return layer.k_buf, layer.v_buf
        return layer.k_buf[self.index: self.index + 1], layer.v_buf[self.index: self.index + 1]

    def _reshape_layer(self, layer: _TreeKVLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        index = next(i for i, mine in enumerate(self.layers) if mine is layer)
        mine = self.owner.layers[index]
        self.owner._reshape_layer(mine, key_states, value_states)
        layer.k_buf, layer.v_buf = self._narrow(mine)
        layer.keys, layer.values = layer.k_buf.transpose(1, 2), layer.v_buf.transpose(1, 2)

    def keep_rows(self, rows: torch.Tensor) -> None:
        raise NotImplementedError("TreeKVCache.row: a row view cannot drop rows")
