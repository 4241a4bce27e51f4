"""Tree attention in Triton: split-KV (flash-decoding) over the prefix, one masked tile for the tree.

Work layout. One program handles one (batch row b, KV head, KV split, block of query rows).
The query rows of a program are all T tree nodes times the Hq / Hkv query heads sharing the
KV head, packed as rows m = node * group + g of one [BLOCK_M, D] tile, so each K/V tile of
the cache is loaded once for all of them (decode-time attention is bandwidth bound: the
cache read is the cost). The prefix keys 0 .. L_b - 1 are split into `num_splits` equal
chunks, computed in the kernel from L_b (no host sync); they need no mask beyond the L_b
bound. The last split also does the tree: keys L_b + j, j < T, visible to node i iff bit j
of its ancestor mask is set (packed int64 words, or a bool mask read directly).

Each split keeps an fp32 online softmax (exp2, scale folded with log2 e) and writes its
normalised partial output and log-sum-exp; `_combine_kernel` merges the splits. With one
split the first kernel writes the output directly.

Slots a query may not see are never loaded into its sum: loads past L_b give 0, and
non-finite tree values enter the product as 0 and are put back as NaN only in the rows that
see them, so garbage (even NaN) in unused cache slots does not leak into the output, and NaN
in the inputs a query sees makes its output NaN: the reference's contract.

Options, constexpr-switched so the default path compiles as before: SOFTCAP applies
c * tanh(score / c) to the (natural-unit) scores before masking; WINDOW (a sliding window W)
gives each query row its sequence position L_b + depth (depths computed by the launcher from
the mask) and hides keys at or before position - W: the prefix splits then cover only keys
from L_b - W + 1 on, and tree keys need the mask and the window. V has its own head dim
(BLOCK_DV; MLA), the output and the partials too.

Paged caches (PAGED): K and V are pools of pages [num_pages, page_size, Hkv, D] and key s of
row b is at page block_table[b, s // PAGE_SIZE], slot s % PAGE_SIZE; each tile looks up the
page of every key it loads (a gather from the block table row, which stays in L1), so page
sizes need not divide the tile and pages may come in any order. PAGE_SIZE is a constexpr:
powers of two (16, 32, 64) compile to shifts and masks.
"""

import contextlib
import functools

import torch
import triton
import triton.language as tl

MAX_HEAD_DIM = 256


def interpreted() -> bool:
    """Whether these kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_split_kernel, triton.runtime.JITFunction)


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr):
    """One online-softmax step (base 2) over a KV tile: scores of invisible keys are -inf.
    SOFTCAP: softcap * tanh(score / softcap) on the natural-unit score (qk_scale holds log2 e)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^(2x) + 1): exact limits at +-inf (e^(2x) -> inf or 0).
        log2e = 1.4426950408889634
        x = s / (log2e * softcap)
        s = (1.0 - 2.0 / (tl.math.exp2(2.0 * log2e * x) + 1.0)) * (softcap * log2e)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_offsets(keys, key_ok, bt_row_ptr, stride_kp, stride_ks, stride_vp, stride_vs,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of the K and V rows of `keys` (a [BLOCK_N] vector of positions) from the
    row's base pointers: position * stride in a dense cache; page * page stride + slot * stride
    in a paged one (page ids of masked-off keys are not loaded: page 0 stands in)."""
    if PAGED:
        page = tl.load(bt_row_ptr + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % PAGE_SIZE
        return page * stride_kp + slot * stride_ks, page * stride_vp + slot * stride_vs
    else:
        return keys * stride_ks, keys * stride_vs


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, seqlens_ptr, out_ptr, part_o_ptr, part_lse_ptr, bt_ptr, depth_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_mb, stride_mt, stride_mw,
    stride_ob, stride_ot, stride_oh,
    stride_btb,
    num_nodes, head_dim, qk_scale, num_splits, num_m_blocks,
    value_dim, window, softcap,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PACKED: tl.constexpr, PRECISION: tl.constexpr,
    PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1,
    BLOCK_DV: tl.constexpr = 16, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    pid0 = tl.program_id(0)
    split = pid0 % num_splits
    m_block = pid0 // num_splits
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows: node * GROUP + g
    num_rows = num_nodes * GROUP
    row_ok = rows < num_rows
    node = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    vdims = tl.arange(0, BLOCK_DV)
    vdim_ok = vdims < value_dim

    q = tl.load(
        q_ptr + b * stride_qb + node[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if PAGED:  # stride_kb / stride_vb are page strides; rows are found through the block table
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
    else:
        k_base = k_ptr + b * stride_kb + kv_head * stride_kh
        v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    bt_row = bt_ptr + b * stride_btb

    prefix_len = tl.load(seqlens_ptr + b)
    first = 0
    if WINDOW:
        # The root (position L_b) sees nothing at or before L_b - window; later nodes less.
        first = tl.maximum(prefix_len - window + 1, 0)
        query_pos = prefix_len + tl.load(depth_ptr + b * num_nodes + node, mask=row_ok, other=0)
    chunk = tl.cdiv(tl.cdiv(prefix_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, prefix_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)

    # Prefix: every key below L_b is visible to every query (in its window).
    for start in range(lo, hi, BLOCK_N):
        keys = start + cols
        key_ok = keys < hi
        k_off, v_off = _kv_offsets(keys, key_ok, bt_row, stride_kb, stride_ks, stride_vb, stride_vs, PAGED, PAGE_SIZE)
        k = tl.load(k_base + k_off[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_base + v_off[:, None] + vdims[None, :], mask=key_ok[:, None] & vdim_ok[None, :], other=0.0)
        visible = key_ok[None, :]
        if WINDOW:
            visible = visible & (query_pos[:, None] - keys[None, :] < window)
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, PRECISION, SOFTCAP)

    # Tree: keys L_b + j, j < T, visible per the ancestor mask; done by the last split.
    if split == num_splits - 1:
        for start in range(0, num_nodes, BLOCK_N):
            tree_cols = start + cols
            col_ok = tree_cols < num_nodes
            if PACKED:
                words = tl.load(
                    mask_ptr + b * stride_mb + node[:, None] * stride_mt + (tree_cols // 64)[None, :] * stride_mw,
                    mask=row_ok[:, None] & col_ok[None, :], other=0,
                )
                visible = ((words >> (tree_cols % 64).to(tl.int64)[None, :]) & 1) != 0
            else:
                visible = tl.load(
                    mask_ptr + b * stride_mb + node[:, None] * stride_mt + tree_cols[None, :] * stride_mw,
                    mask=row_ok[:, None] & col_ok[None, :], other=0,
                ) != 0
            visible = visible & row_ok[:, None] & col_ok[None, :]
            if WINDOW:  # an ancestor d levels up is d positions back
                col_depth = tl.load(depth_ptr + b * num_nodes + tree_cols, mask=col_ok, other=0)
                visible = visible & (query_pos[:, None] - (prefix_len + col_depth)[None, :] < window)
            keys = prefix_len + tree_cols
            k_off, v_off = _kv_offsets(keys, col_ok, bt_row, stride_kb, stride_ks, stride_vb, stride_vs, PAGED, PAGE_SIZE)
            k = tl.load(k_base + k_off[:, None] + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
            v = tl.load(v_base + v_off[:, None] + vdims[None, :], mask=col_ok[:, None] & vdim_ok[None, :], other=0.0)
            # A zero probability times NaN is NaN: non-finite tree values enter the product as
            # 0 and come back as NaN only in the rows that see them (NaN in, NaN out, no leak
            # into rows for which the node is not an ancestor).
            v_bad = (v != v) | (tl.abs(v.to(tl.float32)) == float("inf"))
            v = tl.where(v_bad, 0.0, v).to(v.dtype)
            m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, softcap, PRECISION, SOFTCAP)
            # Counts of 0/1 products: exact in an fp16 tensor-core dot with fp32 sums (an fp32
            # "ieee" dot here made the compiler spill the whole kernel's registers).
            sees_bad = tl.dot(visible.to(tl.float16), v_bad.to(tl.float16)) > 0.0
            acc = tl.where(sees_bad, float("nan"), acc)

    if num_splits == 1:
        # Rows that saw no weight at all get 0 / 0 = NaN, the reference's softmax over nothing
        # (as the merged path gives); padding rows of the tile are not stored.
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + node[:, None] * stride_ot + head[:, None] * stride_oh + vdims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & vdim_ok[None, :],
        )
    else:
        # Partials: [B, Hkv, num_splits, M_pad, BLOCK_DV] fp32 outputs and [.., M_pad] log2-sum-exp2.
        # A NaN sum (NaN in q or a key) counts as mass: its NaN must reach the combined output.
        has_mass = (l_i > 0.0) | (l_i != l_i)
        out = acc / tl.where(has_mass, l_i, 1.0)[:, None]
        lse = tl.where(has_mass, m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        num_kv_heads = tl.num_programs(1)
        m_pad = num_m_blocks * BLOCK_M
        part = ((b * num_kv_heads + kv_head) * num_splits + split) * m_pad + rows
        tl.store(part_lse_ptr + part, lse)
        tl.store(part_o_ptr + part[:, None] * BLOCK_DV + vdims[None, :], out)


@triton.jit
def _combine_kernel(
    out_ptr, part_o_ptr, part_lse_ptr,
    stride_ob, stride_ot, stride_oh,
    head_dim, num_splits, m_pad,
    GROUP: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    num_kv_heads = tl.num_programs(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    part = ((b * num_kv_heads + kv_head) * num_splits + splits) * m_pad + row
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.math.exp2(lse - lse_max)  # 0 for empty splits
    o = tl.load(part_o_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=split_ok[:, None], other=0.0)
    out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
    node = row // GROUP
    head = kv_head * GROUP + row % GROUP
    tl.store(
        out_ptr + b * stride_ob + node * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty), mask=dims < head_dim,
    )


def _on_device(device: torch.device):
    """The CUDA device context for a launch on `device` (Triton launches on the current
    device); nothing for CPU tensors (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def launch_config(dtype: torch.dtype, head_dim: int, rows: int):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) of the split kernel.

    Sized to stay within sm_80's 163 KiB of shared memory (checked by compiling for sm_80 and
    sm_90 in the tests): fp32 inputs take half-width key tiles, and one stage at D = 256.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(max(16, triton.next_power_of_2(rows)), 64 if block_d <= 128 else 32)
    block_n = 32 if block_d > 128 or dtype == torch.float32 else 64
    num_stages = 1 if dtype == torch.float32 and block_d > 128 else 2
    num_warps = 4 if block_m * block_d <= 64 * 64 else 8
    return block_m, block_n, block_d, num_warps, num_stages


def choose_num_splits(batch: int, num_kv_heads: int, num_m_blocks: int, rows: int, cache_len: int, num_sms: int) -> int:
    """KV splits per (row, KV head, row block), from shapes only (no host sync).

    Enough programs to fill the GPU about twice, each split at least 256 keys of the
    allocated cache, and the fp32 partials (splits x rows x D x 8 bytes written and read)
    small next to the cache read (cache_len x D x 4 bytes for fp16 K and V).
    """
    programs = batch * num_kv_heads * num_m_blocks
    want = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, cache_len // 256)
    by_partials = max(1, cache_len // (4 * rows))
    return max(1, min(want, by_length, by_partials, 64))


def tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale: float, window: int = 0,
                   softcap: float = 0.0, *, num_splits=None, block_table=None) -> torch.Tensor:
    """Same normalised arguments and result as `specdec_kernels.ops.reference.tree_attention`.

    q [B, T, Hq, D]; k/v_cache [B, S, Hkv, D] (any strides, contiguous last dim); tree_mask
    bool [B, T, T] (stride-0 batch fine) or packed int64 [B, T, ceil(T/64)]; cache_seqlens
    int32 [B]; v_cache may have its own head dim Dv; window / softcap: 0 for none. Returns a
    contiguous [B, T, Hq, Dv] tensor in q's dtype. `num_splits` overrides
    the split heuristic (tests). With block_table (int32 [B, P], validated by the caller)
    k/v_cache are paged pools [num_pages, page_size, Hkv, D], as in
    `reference.tree_attention_paged`.
    """
    batch, num_nodes, num_q_heads, head_dim = q.shape
    cache_len, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    paged = block_table is not None
    if paged:
        page_size = k_cache.shape[1]
        cache_len = block_table.shape[1] * page_size  # the logical capacity of each row
        block_table = block_table.contiguous()  # page ids read with stride 1 along a row
    group = num_q_heads // num_kv_heads
    value_dim = v_cache.shape[3]
    if head_dim > MAX_HEAD_DIM or value_dim > MAX_HEAD_DIM:
        raise ValueError(f"q: the Triton tree_attention supports head dims up to {MAX_HEAD_DIM}, got D={head_dim}, "
                         f"Dv={value_dim}")
    is_interpreted = interpreted()
    if q.device.type != "cuda" and not is_interpreted:
        raise RuntimeError(
            "backend='triton' on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before specdec_kernels.ops.triton is first imported"
        )
    out = torch.empty((batch, num_nodes, num_q_heads, value_dim), dtype=q.dtype, device=q.device)
    compute_dtype = q.dtype
    if is_interpreted and q.dtype == torch.bfloat16:
        # The interpreter (numpy) has no bf16: compute in fp32 there.
        q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
        compute_dtype = torch.float32
    cache_seqlens = cache_seqlens.contiguous()  # the kernel reads it with stride 1
    packed = tree_mask.dtype != torch.bool
    depth = cache_seqlens  # unread without a window
    if window > 0:
        # Each node's depth (its ancestors in the mask), int32 [B, T]: its position is L_b + depth.
        from ..reference.tree import unpack_tree_mask

        dense = unpack_tree_mask(tree_mask, num_nodes) if packed else tree_mask
        depth = (dense.sum(dim=2) - 1).to(torch.int32).contiguous()
    if not packed:
        # Triton has no bool pointers on every path; a uint8 view of the same bytes keeps strides.
        tree_mask = tree_mask.view(torch.uint8)
    precision = "ieee" if compute_dtype == torch.float32 else None  # exact fp32, not tf32

    rows = num_nodes * group
    block_m, block_n, block_d, num_warps, num_stages = launch_config(compute_dtype, max(head_dim, value_dim), rows)
    block_dv = max(16, triton.next_power_of_2(value_dim))
    num_m_blocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, num_m_blocks, rows, cache_len, _num_sms(q.device))
    num_splits = max(1, int(num_splits))
    m_pad = num_m_blocks * block_m
    if num_splits > 1:
        part_o = torch.empty((batch, num_kv_heads, num_splits, m_pad, block_dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_kv_heads, num_splits, m_pad), dtype=torch.float32, device=q.device)
    else:  # unused; fp32 like the real ones, so one compiled kernel serves every split count
        part_o = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)
    qk_scale = float(scale) * 1.4426950408889634  # log2(e): the kernels use exp2
    with _on_device(q.device):  # Triton launches on the current device, not the tensors'
        _split_kernel[(num_m_blocks * num_splits, num_kv_heads, batch)](
            q, k_cache, v_cache, tree_mask, cache_seqlens, out, part_o, part_lse,
            block_table if paged else cache_seqlens,  # unread when not paged
            depth,
            q.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            block_table.stride(0) if paged else 0,
            num_nodes, head_dim, qk_scale, num_splits, num_m_blocks,  # runtime: no recompile as the cache grows
            value_dim, int(window), float(softcap) if softcap > 0 else 1.0,
            GROUP=group,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
            PACKED=packed, PRECISION=precision,
            PAGED=paged, PAGE_SIZE=page_size if paged else 1,
            BLOCK_DV=block_dv, WINDOW=window > 0, SOFTCAP=softcap > 0,
            num_warps=num_warps, num_stages=num_stages,
        )
        if num_splits > 1:
            _combine_kernel[(rows, num_kv_heads, batch)](
                out, part_o, part_lse,
                out.stride(0), out.stride(1), out.stride(2),
                value_dim, num_splits, m_pad,
                GROUP=group,
                BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_dv,
                num_warps=4,
            )
    return out
