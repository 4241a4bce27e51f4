"""Argument validation: one function per op, shared by every backend, called once per call.

Each public op calls its function here (`_checks.tree_attention(...)` for `tree_attention`,
...), which checks the arguments and returns them in the normalised form every backend takes
(dtypes, [B, ...] views, per-row tensors); the op then dispatches. So every backend rejects
bad input the same way, and a new shape or dtype rule is one edit here. The compiled kernels
keep their own metadata checks only for direct `torch.ops.specdec` calls.

Two kinds of checks:
* metadata (shapes, dtypes, devices, scalar arguments): always. They are written for the
  common case to cost little (a call with value checks off spends ~1-2 us in Python).
* values (token ids in range, parents in topological order, lengths in range, ...): need the
  data, hence a device->host sync on GPU. They run unless `config.values_checked()` is False,
  and never while tracing with torch.compile or capturing a CUDA graph.
"""

import functools
import math
from typing import Optional

import torch

from .. import config

Tensor = torch.Tensor
INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NGRAM_POLICIES = ("earliest", "latest")
# |sum - 1| allowed for a row of draft probabilities: 16-bit probabilities carry about three
# significant digits (bf16 rounds 0.998 to 0.996 or 1.0), fp32 ones about seven.
# 1e-2 for every dtype: probabilities rounded to 16 bits and then widened to fp32 (a common
# way to store draft distributions) sum to 1 only within 16-bit rounding.
DRAFT_PROBS_TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 1e-2, torch.float16: 1e-2}

_has_cuda: Optional[bool] = None  # torch.cuda.is_available(), asked once (it costs ~1 us)
_is_compiling = torch.compiler.is_compiling


# ============================================================================ primitives


def checking_values() -> bool:
    """Whether value checks (which may sync with the GPU) should run now."""
    global _has_cuda
    if _is_compiling() or not config.values_checked():  # dynamo cannot trace ContextVar.get
        return False
    if _has_cuda is None:
        _has_cuda = torch.cuda.is_available()
    return not (_has_cuda and torch.cuda.is_current_stream_capturing())


def fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def _dtype_names(dtypes) -> list:
    return [str(d).replace("torch.", "") for d in dtypes]


def tensor(name, x, dims=None, dtypes=None):
    """x is a tensor with `dims` dimensions (an int or a tuple of allowed ones) and one of `dtypes`."""
    if not isinstance(x, Tensor):
        fail(name, f"expected a torch.Tensor, got {type(x).__name__}")
    if dims is not None:
        ndim = x.dim()
        if (ndim != dims) if type(dims) is int else (ndim not in dims):
            allowed = (dims,) if type(dims) is int else dims
            fail(name, f"expected {' or '.join(f'{d}-D' for d in allowed)} tensor, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        fail(name, f"expected dtype in {_dtype_names(dtypes)}, got {x.dtype}")


def shape(name, x, expected, hint: str = ""):
    """x.shape equals `expected` (None entries match anything)."""
    actual = x.shape
    if len(actual) != len(expected) or any(e is not None and s != e for s, e in zip(actual, expected)):
        shown = tuple("*" if e is None else e for e in expected)
        fail(name, f"expected shape {shown}, got {tuple(actual)}{hint}")


def same_device(reference_name, reference, **tensors):
    """Every tensor given (None skipped) lives on `reference`'s device."""
    device = reference.device
    for name, x in tensors.items():
        if x is not None and x.device != device:
            fail(name, f"expected a tensor on {device} (like {reference_name}), got {x.device}")


def _all_on(device, *tensors) -> bool:
    """Fast test for the common case of `same_device` (call it for the error otherwise)."""
    for x in tensors:
        if x.device != device:
            return False
    return True


def nonempty_batch(name, x):
    if x.shape[0] == 0:
        fail(name, "empty batch (batch size 0); pass at least one row")


def last_dim_contiguous(name, x):
    if not x.is_contiguous() and x.stride(-1) != 1:  # is_contiguous() is the cheap common case
        fail(name, f"the last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")


def int_arg(name, value, *, minimum=None):
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(name, f"expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        fail(name, f"expected >= {minimum}, got {value}")


def as_dtype(x: Tensor, dtype) -> Tensor:
    """x in `dtype`, without a torch call when it already is (a no-op `.to` costs ~1 us)."""
    return x if x.dtype == dtype else x.to(dtype)


def _first_index(bad: Tensor) -> tuple:
    return tuple(int(v) for v in torch.nonzero(bad)[0])


# ============================================================================ trees


def parents_2d(value, name: str = "parents") -> Tensor:
    """Validated int64 [B, T] view of a [B, T] or [T] parent array."""
    tensor(name, value, (1, 2), INT_DTYPES)
    return _parents_rows(name, value)


def _parents_rows(name, value: Tensor) -> Tensor:
    """`parents_2d` for a value already known to be a 1-D or 2-D integer tensor."""
    rows = value if value.dim() == 2 else value.unsqueeze(0)
    nonempty_batch(name, rows)
    if rows.shape[1] == 0:
        fail(name, "a tree has at least one node (the root); got T = 0")
    rows = as_dtype(rows, torch.int64)
    if checking_values():
        _parent_values(name, rows)
    return rows


def _parent_values(name, parents: Tensor):
    """Values of a [B, T] parent array: root, topological order, trailing padding only."""
    num_nodes = parents.shape[1]
    root = parents[:, 0]
    if (root != -1).any():
        b = int(torch.nonzero(root != -1)[0, 0])
        fail(name, f"node 0 is the root and must have parent -1, got {int(root[b])} in row {b}")
    node = torch.arange(num_nodes, device=parents.device)
    bad = (parents < -1) | (parents >= node)
    bad[:, 0] = False
    if bad.any():
        b, i = _first_index(bad)
        fail(
            name,
            f"parents must be in topological order (-1 <= parents[b, i] < i); got parents[{b}, {i}] = "
            f"{int(parents[b, i])}",
        )
    is_pad = parents == -1
    is_pad[:, 0] = False
    # Padding is trailing: once a node is padding, every later node is too.
    pad_then_real = is_pad[:, :-1] & ~is_pad[:, 1:]
    if pad_then_real.any():
        b, i = _first_index(pad_then_real)
        fail(name, f"padding nodes (parent -1) must be trailing, but node {i + 1} of row {b} follows padding node {i}")


def real_nodes(parents: Tensor) -> Tensor:
    """bool [B, T]: the root and every node with a parent (not padding)."""
    real = parents >= 0
    real[:, 0] = True
    return real


def token_ids(name, tokens: Tensor, valid: Tensor, vocab_size: int):
    """tokens[valid] all in [0, vocab_size) (a value check: call it under `checking_values()`)."""
    bad = valid & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        index = _first_index(bad)
        fail(name, f"token id {int(tokens[index])} at {list(index)} is outside the vocabulary [0, {vocab_size})")


def tree_mask(parents):
    """`tree_mask(parents)` -> (int64 contiguous [B, T] parents,)."""
    return (parents_2d(parents).contiguous(),)


def pack_tree_mask(mask):
    """`pack_tree_mask(mask)` -> (contiguous bool [B, T, K] mask,)."""
    tensor("mask", mask, (2, 3), (torch.bool,))
    return ((mask if mask.dim() == 3 else mask.unsqueeze(0)).contiguous(),)


def token_tree(tokens, parents):
    """`TokenTree(tokens, parents)` -> (tokens, int64 [B, T] parents expanded to the batch)."""
    tensor("tokens", tokens, 2, INT_DTYPES)
    batch, num_nodes = tokens.shape
    rows = parents_2d(parents)  # a [T] input becomes [1, T]
    shape("parents", rows, (batch if parents.dim() == 2 else 1, num_nodes))
    rows = rows.expand(batch, -1)
    same_device("tokens", tokens, parents=rows)
    return tokens, rows


# ============================================================================ tree attention


def _hf_layout_hint(q, k_cache) -> str:
    """A hint for the likely mistake of passing a Hugging Face [B, H, S, D] cache as is: read
    as [B, S, H, D], its head count would fit the queries' and its "sequence" is short."""
    heads_if_transposed = k_cache.shape[1]
    if heads_if_transposed > 0 and q.shape[2] % heads_if_transposed == 0 and k_cache.shape[2] != heads_if_transposed:
        return (
            f"; if k_cache/v_cache are Hugging Face [B, H, S, D] tensors (H = {heads_if_transposed}), pass "
            "k_cache.transpose(1, 2) and v_cache.transpose(1, 2) (views, no copy)"
        )
    return ""


def tree_attention(q, k_cache, v_cache, tree_mask, cache_seqlens, scale):
    """`tree_attention(...)` -> (q, k_cache, v_cache, [B, T, *] mask, int32 cache_seqlens, float scale)."""
    tensor("q", q, 4, FLOAT_DTYPES)
    dtype = (q.dtype,)
    tensor("k_cache", k_cache, 4, dtype)
    tensor("v_cache", v_cache, 4, dtype)
    tensor("cache_seqlens", cache_seqlens, 1, INT_DTYPES)
    tensor("tree_mask", tree_mask, (2, 3), (torch.bool, torch.int64))
    batch, num_nodes, num_q_heads, head_dim = q.shape
    if batch == 0:
        fail("q", "empty batch (batch size 0); pass at least one row")
    if num_nodes == 0:
        fail("q", f"expected T >= 1 tree nodes, got shape {tuple(q.shape)}")
    k_shape = k_cache.shape
    if k_shape[0] != batch or k_shape[3] != head_dim:
        shape("k_cache", k_cache, (batch, None, None, head_dim))
    if v_cache.shape[:3] != k_shape[:3]:
        shape("v_cache", v_cache, tuple(k_shape[:3]) + (None,))  # its own head dim Dv (MLA)
    num_kv_heads = k_shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        fail(
            "k_cache",
            f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}) (caches are "
            f"[B, S, Hkv, D], got shape {tuple(k_shape)}){_hf_layout_hint(q, k_cache)}",
        )
    if cache_seqlens.shape[0] != batch:
        shape("cache_seqlens", cache_seqlens, (batch,))
    mask = tree_mask if tree_mask.dim() == 3 else tree_mask.unsqueeze(0).expand(batch, -1, -1)
    mask_cols = num_nodes if tree_mask.dtype == torch.bool else (num_nodes + 63) // 64
    if mask.shape != (batch, num_nodes, mask_cols):
        q_hint = ""
        if tree_mask.dtype == torch.bool and mask.shape[1:] == (q.shape[2], q.shape[2]):
            q_hint = "; q looks like a Hugging Face [B, H, T, D] tensor: pass q.transpose(1, 2)"
        shape("tree_mask", mask, (batch, num_nodes, mask_cols), q_hint)
    if not _all_on(q.device, k_cache, v_cache, tree_mask, cache_seqlens):
        same_device("q", q, k_cache=k_cache, v_cache=v_cache, tree_mask=tree_mask, cache_seqlens=cache_seqlens)
    last_dim_contiguous("q", q)
    last_dim_contiguous("k_cache", k_cache)
    last_dim_contiguous("v_cache", v_cache)
    if checking_values():
        cache_len = k_shape[1]
        if cache_seqlens.is_cpu and batch <= 4096:
            # Small host tensors: reading the values beats launching four torch ops.
            values = cache_seqlens.tolist()
            b = next((b for b, n in enumerate(values) if n < 0 or n + num_nodes > cache_len), None)
        else:
            bad = (cache_seqlens < 0) | (cache_seqlens + num_nodes > cache_len)
            b = int(torch.nonzero(bad)[0, 0]) if bad.any() else None
        if b is not None:
            fail(
                "cache_seqlens",
                f"row {b}: prefix {int(cache_seqlens[b])} + T={num_nodes} tree entries must fit in the cache "
                f"(S={cache_len}){_hf_layout_hint(q, k_cache)}",
            )
    scale = head_dim**-0.5 if scale is None else float(scale)
    return q, k_cache, v_cache, mask, as_dtype(cache_seqlens, torch.int32), scale  # every kernel reads int32


def window_softcap(window, softcap) -> tuple:
    """(window, softcap) as the ops take them: None -> 0 (no window) / 0.0 (no capping)."""
    if window is None:
        window = 0
    elif isinstance(window, bool) or not isinstance(window, int) or window < 1:
        fail("window", f"expected None or an int >= 1 (a sliding window in tokens), got {window!r}")
    if softcap is None:
        softcap = 0.0
    else:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
            fail("softcap", f"expected None or a finite float > 0 (logit soft-capping), got {softcap!r}")
        softcap = float(softcap)
    return window, softcap


# ============================================================================ verify


def _target_logits(target_logits):
    tensor("target_logits", target_logits, 3, FLOAT_DTYPES)
    batch, num_nodes, vocab = target_logits.shape
    if batch == 0:
        fail("target_logits", "empty batch (batch size 0); pass at least one row")
    if num_nodes == 0 or vocab == 0:
        fail("target_logits", f"expected T >= 1 nodes and V >= 1 tokens, got shape {tuple(target_logits.shape)}")
    last_dim_contiguous("target_logits", target_logits)
    return batch, num_nodes, vocab


def _draft_probs_meta(draft_probs, expected_shape, target_logits):
    tensor("draft_probs", draft_probs, 3, FLOAT_DTYPES)
    shape("draft_probs", draft_probs, expected_shape)
    same_device("target_logits", target_logits, draft_probs=draft_probs)


def draft_prob_values(draft_probs: Tensor, rows: Optional[Tensor]):
    """draft_probs[rows] ([B, T] bool, None: all) are distributions: no NaN, nothing negative,
    each sums to 1 within DRAFT_PROBS_TOLERANCE (a value check)."""
    picked = draft_probs.reshape(-1, draft_probs.shape[-1]) if rows is None else draft_probs[rows]
    if picked.numel() == 0:
        return
    picked = picked.float()
    tol = DRAFT_PROBS_TOLERANCE[draft_probs.dtype]
    where = torch.nonzero(rows) if rows is not None else None

    def row_name(r: int) -> str:
        b, i = (int(v) for v in where[r]) if where is not None else divmod(r, draft_probs.shape[1])
        return f"draft_probs[{b}, {i}]"

    nan = picked.isnan().any(-1)
    if nan.any():
        fail("draft_probs", f"{row_name(int(torch.nonzero(nan)[0, 0]))} holds NaN; every node with children "
             "needs the distribution its children were drawn from")
    negative = (picked < 0).any(-1)
    if negative.any():
        fail("draft_probs", f"{row_name(int(torch.nonzero(negative)[0, 0]))} has negative entries; expected "
             "probabilities (>= 0, summing to 1), not logits")
    total = picked.sum(-1, dtype=torch.float64)
    off = (total - 1).abs() > tol
    if off.any():
        r = int(torch.nonzero(off)[0, 0])
        fail("draft_probs", f"{row_name(r)} sums to {float(total[r]):.6g}, expected 1 within {tol:g} (a "
             "distribution, e.g. a softmax; not logits or scores)")


def _distinct_siblings(tree_tokens, parents, drafted):
    """Deterministic drafts need distinct siblings: the target picks one token per node."""
    same_parent = parents[:, :, None] == parents[:, None, :]
    same_token = tree_tokens[:, :, None] == tree_tokens[:, None, :]
    both = drafted[:, :, None] & drafted[:, None, :]
    earlier = torch.ones_like(same_parent).triu(diagonal=1)
    repeated = same_parent & same_token & both & earlier
    if repeated.any():
        b, i, j = _first_index(repeated)
        fail(
            "tree_tokens",
            f"row {b}: sibling nodes {i} and {j} both hold token {int(tree_tokens[b, i])}; with "
            "draft_probs=None siblings must be distinct (pass draft_probs if they were sampled)",
        )


def per_row(name, value, batch, like: Tensor, dtype, *, default, integral=False):
    """A scalar or a [B] tensor -> a [B] tensor of `dtype` on `like`'s device (`integral`: ints only)."""
    if value is None:
        value = default
    kind = "an int" if integral else "a number"
    if isinstance(value, Tensor):
        if integral and value.dtype not in INT_DTYPES:
            fail(name, f"expected {kind} or an integer [B] tensor, got dtype {value.dtype}")
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        shape(name, value, (batch,))
        same_device("target_logits", like, **{name: value})
        return as_dtype(value, dtype)
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        fail(name, f"expected {kind} or a [B] tensor, got {value!r}")
    if (_is_compiling() or type(like) is not Tensor or torch._C._len_torch_dispatch_stack() > 0
            or (like.is_cuda and torch.cuda.is_current_stream_capturing())):
        # Traced, fake or subclass tensors: a fresh tensor of their kind, never the cache. Under
        # CUDA-graph capture the fill only runs at replay, in the graph's pool: a cached one
        # would hand uninitialised memory to later eager calls.
        return torch.full((batch,), value, dtype=dtype, device=like.device)
    return _filled(value, batch, dtype, like.device)


@functools.lru_cache(maxsize=64)
def _filled(value, batch, dtype, device) -> Tensor:
    """torch.full((batch,), value): one tensor per distinct call, reused (a fresh one costs
    ~2 us). The ops only read their inputs, and no caller gets this tensor back."""
    return torch.full((batch,), value, dtype=dtype, device=device)


def sampling(target_logits, temperature, top_k, top_p, batch):
    """The per-row sampling arguments of `verify` / `verify_chain` -> (fp32 temperature,
    int64 top_k, fp32 top_p), each [B] on target_logits' device. (The seed becomes per-row
    seeds by `philox.row_seeds`, which checks it.)"""
    temperature = per_row("temperature", temperature, batch, target_logits, torch.float32, default=1.0)
    top_k = per_row("top_k", top_k, batch, target_logits, torch.int64, default=0, integral=True)
    top_p = per_row("top_p", top_p, batch, target_logits, torch.float32, default=1.0)
    if checking_values():
        if not torch.isfinite(temperature).all() or (temperature < 0).any():
            fail("temperature", "expected finite values >= 0 (0 = greedy)")
        if (top_k < 0).any():
            fail("top_k", "expected values >= 0 (0 = off)")
        if not ((top_p > 0) & (top_p <= 1)).all():
            fail("top_p", "expected values in (0, 1] (1 = off)")
    return temperature, top_k, top_p


def verify(target_logits, tree_tokens, parents, draft_probs, temperature, top_k, top_p):
    """`verify(...)` -> the arguments of the `verify` op but the seed: (target_logits, int64
    tree_tokens, int64 [B, T] parents, draft_probs, temperature, top_k, top_p)."""
    batch, num_nodes, vocab = _target_logits(target_logits)
    tensor("tree_tokens", tree_tokens, 2, INT_DTYPES)
    if tree_tokens.shape != (batch, num_nodes):
        shape("tree_tokens", tree_tokens, (batch, num_nodes))
    tensor("parents", parents, (1, 2), INT_DTYPES)
    if parents.shape[-1] != num_nodes or (parents.dim() == 2 and parents.shape[0] != batch):
        shape("parents", parents, (batch, num_nodes)[2 - parents.dim() :])
    if draft_probs is not None:
        _draft_probs_meta(draft_probs, (batch, num_nodes, vocab), target_logits)
    if not _all_on(target_logits.device, tree_tokens, parents):
        same_device("target_logits", target_logits, tree_tokens=tree_tokens, parents=parents)
    rows = _parents_rows("parents", parents)
    if rows.shape[0] != batch:
        rows = rows.expand(batch, -1)  # one tree shared by every row
    if checking_values():
        drafted = real_nodes(rows)
        drafted[:, 0] = False
        token_ids("tree_tokens", tree_tokens, drafted, vocab)
        # The root is not read, but it is the sequence's last token: in [0, V), or -1 for "no
        # token" (what ngram_propose_tree returns for an empty history).
        root = tree_tokens[:, 0]
        if ((root < -1) | (root >= vocab)).any():
            b = int(torch.nonzero((root < -1) | (root >= vocab))[0, 0])
            fail("tree_tokens", f"root token {int(root[b])} of row {b} is outside the vocabulary [0, {vocab}) "
                 "(-1: no root token)")
        if draft_probs is None:
            _distinct_siblings(tree_tokens, rows, drafted)
        else:
            # Only the rows children were drawn from are read: the nodes with children.
            has_children = torch.zeros(batch, num_nodes + 1, dtype=torch.bool, device=rows.device)
            has_children.scatter_(1, torch.where(drafted, rows, num_nodes), True)
            draft_prob_values(draft_probs, has_children[:, :num_nodes])
    sampled = sampling(target_logits, temperature, top_k, top_p, batch)
    return (target_logits, as_dtype(tree_tokens, torch.int64), rows, draft_probs) + sampled


def verify_chain(target_logits, draft_tokens, draft_probs):
    """`verify_chain`'s own arguments -> (batch, K, V); the sampling ones go through `sampling`."""
    batch, num_nodes, vocab = _target_logits(target_logits)
    tensor("draft_tokens", draft_tokens, 2, INT_DTYPES)
    k = num_nodes - 1
    shape("draft_tokens", draft_tokens, (batch, k))
    same_device("target_logits", target_logits, draft_tokens=draft_tokens)
    if draft_probs is not None:
        _draft_probs_meta(draft_probs, (batch, k, vocab), target_logits)
    if checking_values():
        token_ids("draft_tokens", draft_tokens, torch.ones_like(draft_tokens, dtype=torch.bool), vocab)
        if draft_probs is not None:
            draft_prob_values(draft_probs, None)  # draft i was drawn from draft_probs[:, i]: every row
    return batch, k, vocab


# ============================================================================ KV cache


def compact_kv_cache_(caches, cache_seqlens, accepted_nodes, num_accepted):
    """`compact_kv_cache_(...)` -> (list of caches, int32 cache_seqlens, int32 accepted_nodes,
    int32 num_accepted)."""
    caches = list(caches)
    if not caches:
        fail("caches", "expected at least one [B, S, H, D] cache tensor")
    tensor("cache_seqlens", cache_seqlens, 1, INT_DTYPES)
    tensor("accepted_nodes", accepted_nodes, 2, INT_DTYPES)
    tensor("num_accepted", num_accepted, 1, INT_DTYPES)
    batch, width = accepted_nodes.shape
    if cache_seqlens.shape[0] == 0:
        fail("cache_seqlens", "empty batch (batch size 0); pass at least one row")
    if cache_seqlens.shape[0] != batch:
        shape("cache_seqlens", cache_seqlens, (batch,))
    if num_accepted.shape[0] != batch:
        shape("num_accepted", num_accepted, (batch,))
    device = cache_seqlens.device
    on_cpu = cache_seqlens.is_cpu
    for i, cache in enumerate(caches):
        # One cheap test per cache (a model passes two per layer); the named checks only
        # when it fails, for the error.
        if not (
            type(cache) is Tensor and cache.dim() == 4 and cache.dtype in FLOAT_DTYPES and cache.shape[0] == batch
            and (cache.is_cpu if on_cpu else cache.device == device) and (cache.is_contiguous() or cache.stride(-1) == 1)
        ):
            name = f"caches[{i}]"
            tensor(name, cache, 4, FLOAT_DTYPES)
            shape(name, cache, (batch, None, None, None))
            last_dim_contiguous(name, cache)
            same_device("cache_seqlens", cache_seqlens, **{name: cache})
    if not _all_on(device, accepted_nodes, num_accepted):
        same_device("cache_seqlens", cache_seqlens, accepted_nodes=accepted_nodes, num_accepted=num_accepted)
    if checking_values():
        _accepted_paths(caches, cache_seqlens, accepted_nodes, num_accepted)
    return (caches, as_dtype(cache_seqlens, torch.int32), as_dtype(accepted_nodes, torch.int32),
            as_dtype(num_accepted, torch.int32))


def accepted_path_order(accepted_nodes, num_accepted):
    """Each row's path accepted_nodes[b, :num_accepted[b] + 1] (num_accepted already in range)
    starts at node 0 and strictly increases: the compaction kernels move entries in chunks
    up the path, exact only for such paths (dense and paged alike)."""
    width = accepted_nodes.shape[1]
    nodes = accepted_nodes.to(torch.int64)
    on_path = torch.arange(width, device=nodes.device)[None, :] <= num_accepted[:, None]
    if (nodes[:, 0] != 0).any():
        b = int(torch.nonzero(nodes[:, 0] != 0)[0, 0])
        fail("accepted_nodes", f"row {b}: the accepted path starts at the root, node 0; got {int(nodes[b, 0])}")
    rising = nodes[:, 1:] > nodes[:, :-1]
    if (on_path[:, 1:] & ~rising).any():
        b, j = _first_index(on_path[:, 1:] & ~rising)
        fail("accepted_nodes", f"row {b}: the accepted path must strictly increase (a path from the root in a "
             f"topologically ordered tree), got {nodes[b, : int(num_accepted[b]) + 1].tolist()}")


def _accepted_paths(caches, cache_seqlens, accepted_nodes, num_accepted):
    """Each row's path accepted_nodes[b, :num_accepted[b] + 1] starts at node 0, strictly
    increases (so every destination cache_seqlens[b] + j is at or before its source, and the
    moves are exact in any order that goes up the path), and its last node fits in the cache."""
    batch, width = accepted_nodes.shape
    cache_len = min(cache.shape[1] for cache in caches)
    if ((cache_seqlens < 0) | (cache_seqlens >= cache_len)).any():
        b = int(torch.nonzero((cache_seqlens < 0) | (cache_seqlens >= cache_len))[0, 0])
        fail("cache_seqlens", f"row {b}: expected 0 <= cache_seqlens < S = {cache_len} (room for the root at least), "
             f"got {int(cache_seqlens[b])}")
    if ((num_accepted < 0) | (num_accepted >= width)).any():
        fail("num_accepted", f"expected values in [0, {width}) (the width of accepted_nodes), got {num_accepted.tolist()}")
    accepted_path_order(accepted_nodes, num_accepted)
    nodes = accepted_nodes.to(torch.int64)
    last = nodes.gather(1, num_accepted.to(torch.int64)[:, None])[:, 0]  # the largest node on the path
    beyond = cache_seqlens.to(torch.int64) + last >= cache_len
    if beyond.any():
        b = int(torch.nonzero(beyond)[0, 0])
        fail("accepted_nodes", f"row {b}: node {int(last[b])} is at cache_seqlens + node = "
             f"{int(cache_seqlens[b]) + int(last[b])}, past the cache (S = {cache_len})")


# ============================================================================ n-gram drafting


def ngram_query(min_n, max_n, num_tokens, policy, *, max_n_limit: Optional[int] = None):
    """The n-gram match arguments shared by `ngram_propose`, `ngram_propose_tree` and `NgramIndex`."""
    int_arg("min_n", min_n, minimum=1)
    int_arg("max_n", max_n, minimum=1)
    if min_n > max_n:
        fail("min_n", f"expected min_n <= max_n, got min_n={min_n} > max_n={max_n}")
    if max_n_limit is not None and max_n > max_n_limit:
        fail("max_n", f"expected max_n <= the index's max_n = {max_n_limit}, got {max_n}")
    int_arg("num_tokens", num_tokens, minimum=1)
    if policy not in NGRAM_POLICIES:
        fail("policy", f"expected one of {NGRAM_POLICIES}, got {policy!r}")


def nonnegative_tokens(name, tokens: Tensor, counts: Optional[Tensor] = None):
    """tokens[r, :counts[r]] (all of tokens when counts is None) are >= 0: -1 is padding, and no
    negative id is a token (a value check)."""
    if tokens.numel() == 0 or int(tokens.min()) >= 0:  # one reduction for the common case
        return
    if counts is None:
        bad = tokens < 0
    else:
        bad = (tokens < 0) & (torch.arange(tokens.shape[-1], device=tokens.device) < counts[:, None])
    if bad.any():
        index = _first_index(bad)
        fail(name, f"token ids must be >= 0 (-1 is padding, never a token); got {int(tokens[index])} at {list(index)}")


def ngram_propose(tokens, lengths, min_n, max_n, num_tokens, policy):
    """`ngram_propose(...)` / `ngram_propose_tree(...)` histories and match arguments ->
    (tokens, int64 lengths, min_n, max_n, num_tokens, policy)."""
    tensor("tokens", tokens, 2, INT_DTYPES)
    tensor("lengths", lengths, 1, INT_DTYPES)
    batch, max_len = tokens.shape
    if batch == 0:
        fail("tokens", "empty batch (batch size 0); pass at least one row")
    if lengths.shape[0] != batch:
        shape("lengths", lengths, (batch,))
    if lengths.device != tokens.device:
        same_device("tokens", tokens, lengths=lengths)
    ngram_query(min_n, max_n, num_tokens, policy)
    if checking_values():
        if lengths.device.type == "cpu" and batch <= 4096:
            # Small host tensors: reading the values beats launching three torch ops.
            values = lengths.tolist()
            bad = min(values) < 0 or max(values) > max_len
        else:
            bad = bool(((lengths < 0) | (lengths > max_len)).any())
        if bad:
            fail("lengths", f"expected 0 <= lengths[b] <= L = {max_len}")
        nonnegative_tokens("tokens", tokens, lengths)  # past lengths[b]: ignored, -1 padding allowed
    return tokens, as_dtype(lengths, torch.int64), min_n, max_n, num_tokens, policy


def ngram_propose_tree(tokens, lengths, min_n, max_n, num_tokens, tree_width, max_nodes, policy):
    """`ngram_propose_tree(...)` -> the op's arguments (max_nodes None: tree_width * num_tokens)."""
    tokens, lengths, min_n, max_n, num_tokens, policy = ngram_propose(tokens, lengths, min_n, max_n, num_tokens, policy)
    int_arg("tree_width", tree_width, minimum=1)
    if max_nodes is None:
        max_nodes = tree_width * num_tokens
    int_arg("max_nodes", max_nodes, minimum=0)
    return tokens, lengths, min_n, max_n, num_tokens, tree_width, max_nodes, policy
# ----------------------------------------------------------------------------- paged caches
# A paged cache is [num_pages, page_size, H, D]; block_table int32 [B, P] maps row b's token
# s to page block_table[b, s // page_size], slot s % page_size. Only the pages a row uses
# (its first ceil(num_tokens[b] / page_size) entries) are checked: the entries after them are
# padding, as in vLLM's block tables, and no backend reads them.


def block_table(table, *, batch, device, like: str):
    """Metadata of a block table: int32 [batch, P], P >= 1, on `device`."""
    tensor("block_table", table, dims=2, dtypes=(torch.int32,))
    shape("block_table", table, (batch, None))
    if table.shape[1] == 0:
        fail("block_table", f"expected at least one page column, got shape {tuple(table.shape)}")
    if table.device != device:
        fail("block_table", f"expected a tensor on {device} (like {like}), got {table.device}")


def block_table_pages(table, num_tokens, page_size: int, num_pages: int, *, what: str):
    """Values: row b's first ceil(num_tokens[b] / page_size) entries exist and are page ids in
    [0, num_pages). `what` says what num_tokens counts, for the message."""
    if not checking_values():
        return
    pages_needed = (num_tokens.to(torch.int64) + page_size - 1) // page_size  # [B]
    num_cols = table.shape[1]
    short = pages_needed > num_cols
    if short.any():
        b = int(torch.nonzero(short)[0, 0])
        fail(
            "block_table",
            f"row {b} needs {int(pages_needed[b])} pages of {page_size} slots for {what} = "
            f"{int(num_tokens[b])} tokens, but the table has {num_cols} columns",
        )
    used = torch.arange(num_cols, device=table.device)[None, :] < pages_needed[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(v) for v in torch.nonzero(bad)[0])
        fail(
            "block_table",
            f"block_table[{b}, {j}] = {int(table[b, j])} (used by row {b}) is not a page id in [0, {num_pages})",
        )


def block_table_writes_exclusive(table, cache_seqlens, num_nodes: int, page_size: int):
    """Values: the slots compaction writes (each row's tree, positions L_b .. L_b + T - 1) are
    used by no other position of any row. Pages may be shared for reading (a common prefix),
    but a slot written for one row and read by another would change that row's cache, and two
    rows writing one slot would race."""
    if not checking_values():
        return
    batch, num_cols = table.shape
    lengths = cache_seqlens.to(torch.int64)
    num_tokens = lengths + num_nodes  # [B]
    pos = torch.arange(num_cols * page_size, device=table.device)
    used = pos[None, :] < num_tokens[:, None]  # [B, S]
    slots = table.to(torch.int64).gather(1, (pos // page_size)[None, :].expand(batch, -1)) * page_size + pos % page_size
    ids, counts = torch.unique(slots[used], return_counts=True)
    tree = used & (pos[None, :] >= lengths[:, None])
    shared = counts[torch.searchsorted(ids, slots[tree])] > 1
    if shared.any():
        b, s = (int(v) for v in torch.nonzero(tree)[int(torch.nonzero(shared)[0, 0])])
        fail(
            "block_table",
            f"row {b}'s tree slot at position {s} (page {int(table[b, s // page_size])}, slot {s % page_size}) is "
            "also used by another position; the pages a row's tree occupies must be its own "
            "(shared pages are for reading only)",
        )
