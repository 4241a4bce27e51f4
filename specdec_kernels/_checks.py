"""Input validation shared by every backend, so all of them reject bad input the same way.

Two kinds of checks:
* metadata (shapes, dtypes, devices, scalar arguments): always, free.
* values (token ids in range, parents in topological order, lengths in range, ...): need the
  data, hence a device->host sync on GPU. They run unless `config.values_checked()` is False,
  and never while tracing with torch.compile or capturing a CUDA graph.
"""

import torch

from . import config

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def checking_values() -> bool:
    """Whether value checks (which may sync with the GPU) should run now."""
    if torch.compiler.is_compiling() or not config.values_checked():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def tensor(name, x, *, dims=None, dtypes=None):
    """x is a tensor with one of `dims` dimensions and one of `dtypes`."""
    if not isinstance(x, torch.Tensor):
        fail(name, f"expected a torch.Tensor, got {type(x).__name__}")
    if dims is not None:
        dims = (dims,) if isinstance(dims, int) else dims
        if x.dim() not in dims:
            fail(name, f"expected {' or '.join(f'{d}-D' for d in dims)} tensor, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        fail(name, f"expected dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {x.dtype}")


def shape(name, x, expected):
    """x.shape equals `expected` (None entries match anything)."""
    if len(x.shape) != len(expected) or any(e is not None and s != e for s, e in zip(x.shape, expected)):
        shown = tuple("*" if e is None else e for e in expected)
        fail(name, f"expected shape {shown}, got {tuple(x.shape)}")


def on_device(name, x, device, like: str):
    """x lives on `device` (the device of the argument named `like`)."""
    if x.device != device:
        fail(name, f"expected a tensor on {device} (like {like}), got {x.device}")


def same_device(reference_name, reference, **tensors):
    for name, x in tensors.items():
        if x is not None:
            on_device(name, x, reference.device, reference_name)


def nonempty_batch(name, x):
    if x.shape[0] == 0:
        fail(name, "empty batch (batch size 0); pass at least one row")


def last_dim_contiguous(name, x):
    if x.stride(-1) != 1:
        fail(name, f"the last dimension must be contiguous (stride 1), got strides {tuple(x.stride())}")


def int_arg(name, value, *, minimum=None):
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, f"expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        fail(name, f"expected >= {minimum}, got {value}")


def parents(name, parents_2d: torch.Tensor):
    """Values of a [B, T] parent array: root, topological order, trailing padding only."""
    if not checking_values():
        return
    num_nodes = parents_2d.shape[1]
    root = parents_2d[:, 0]
    if (root != -1).any():
        b = int(torch.nonzero(root != -1)[0, 0])
        fail(name, f"node 0 is the root and must have parent -1, got {int(root[b])} in row {b}")
    node = torch.arange(num_nodes, device=parents_2d.device)
    bad = (parents_2d < -1) | (parents_2d >= node)
    bad[:, 0] = False
    if bad.any():
        b, i = (int(v) for v in torch.nonzero(bad)[0])
        fail(
            name,
            f"parents must be in topological order (-1 <= parents[b, i] < i); got parents[{b}, {i}] = "
            f"{int(parents_2d[b, i])}",
        )
    is_pad = parents_2d == -1
    is_pad[:, 0] = False
    # Padding is trailing: once a node is padding, every later node is too.
    pad_then_real = is_pad[:, :-1] & ~is_pad[:, 1:]
    if pad_then_real.any():
        b, i = (int(v) for v in torch.nonzero(pad_then_real)[0])
        fail(name, f"padding nodes (parent -1) must be trailing, but node {i + 1} of row {b} follows padding node {i}")


def parents_2d(value: torch.Tensor, name: str = "parents") -> torch.Tensor:
    """Validated int64 [B, T] view of a [B, T] or [T] parent array."""
    tensor(name, value, dims=(1, 2), dtypes=INT_DTYPES)
    rows = value if value.dim() == 2 else value.unsqueeze(0)
    nonempty_batch(name, rows)
    if rows.shape[1] == 0:
        fail(name, "a tree has at least one node (the root); got T = 0")
    rows = rows.to(torch.int64)
    parents(name, rows)
    return rows


def real_nodes(parents_2d: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the root and every node with a parent (not padding)."""
    real = parents_2d >= 0
    real[:, 0] = True
    return real


def token_ids(name, tokens: torch.Tensor, valid: torch.Tensor, vocab_size: int):
    """tokens[valid] all in [0, vocab_size)."""
    if not checking_values():
        return
    bad = valid & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        index = tuple(int(v) for v in torch.nonzero(bad)[0])
        fail(name, f"token id {int(tokens[index])} at {list(index)} is outside the vocabulary [0, {vocab_size})")


def per_row(name, value, batch, device, dtype, *, default, integral=False):
    """A scalar or a [B] tensor -> a [B] tensor of `dtype` on `device` (`integral`: ints only)."""
    if value is None:
        value = default
    kind = "an int" if integral else "a number"
    if isinstance(value, torch.Tensor):
        if integral and value.dtype not in INT_DTYPES:
            fail(name, f"expected {kind} or an integer [B] tensor, got dtype {value.dtype}")
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        shape(name, value, (batch,))
        on_device(name, value, device, "target_logits")
        return value.to(dtype)
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        fail(name, f"expected {kind} or a [B] tensor, got {value!r}")
    return torch.full((batch,), value, dtype=dtype, device=device)


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
    on_device("block_table", table, device, like)


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
