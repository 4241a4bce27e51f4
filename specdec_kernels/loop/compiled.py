"""The tree-verify forward through `torch.compile`, with static shapes (gpt-fast style).

`generate(..., compile=...)` runs each step's target forward over the token tree through a
compiled graph instead of eager PyTorch. Graphs are specialised on shapes, so shapes are
kept to a handful:

- the tree width T is padded up to a bucket (`WIDTH_BUCKETS`: 1, 2, 4, 8, 16, 32, 64, then
  multiples of 64); padding nodes see only themselves and their outputs are dropped;
- the rows: the cache is allocated for the batch size padded up to a power of two, and when
  rows finish they are moved to the front of the same buffers (no reallocation: CUDA graphs
  keep their addresses) and the forward runs on the rows' bucket (padding rows have an empty
  prefix and a dummy tree);
- the cache capacity S is rounded up to a multiple of `CAPACITY_STEP`, and every forward
  hands attention the whole buffers (`tree_attention` reads each row only up to its own
  length), so no shape depends on how far decoding got.

Our ops (`tree_attention`, and `small_linear` where the CPU calibration routes few-row
linears to it) enter the graph as `torch.ops.specdec` nodes traced through their fake
implementations (`ops/_fake.py`); the graph is compiled with `fullgraph=True`, so a graph
break is an error, never a silent eager fallback. The cache writes are index_put_ on the
cache buffers, which inductor keeps in place.

Compiled graphs live in dynamo's cache of `_tree_forward` for the whole process: its guards
key them on the model object, the shapes and the cache's static settings, so a second
`generate` call with the same model and buckets compiles nothing. The first forward at a
new key compiles (seconds, tens of seconds for a large model on a CPU); that time is
reported as `GenerateStats.time_compile` and the step it happened in is not shown to the
adaptive planner's cost model (it would learn a compile as a step's cost).

Modes: "default" (inductor), and on CUDA "reduce-overhead" (inductor plus CUDA graphs: the
cache buffers are marked as static addresses). On an H200 (fourth GPU window,
`tools/gpu_step_overhead.py`, the default model's shapes in bf16 with random weights),
"reduce-overhead" ran plain decoding at batch 1 and 8 and n-gram chains at batch 1, a plain
batch-1 step in 2.9 ms against eager's 22.4 ms, greedy output equal to eager's; each graph
took ~28 s to compile. `compile="auto"` still never turns it on: a graph repays its compile
only after ~1,500 such steps. Paged caches (`kv_page_size`) are not compiled.
"""

import time
from typing import Optional, Union

import torch

from .hf.attention import SEQLENS_KWARG, TREE_MASK_KWARG, _hidden
from .hf.cache import TreeKVCache
from .hf.families import family

CAPACITY_STEP = 256  # cache capacities are rounded up to a multiple of this
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # tree widths are padded up to one of these (then multiples of 64)
MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
# Graphs per compiled function before dynamo gives up (its default is 8): each model, row
# bucket, width bucket and capacity is one graph, all of them for `_tree_forward`.
RECOMPILE_LIMIT = 64


def width_bucket(width: int) -> int:
    """The padded tree width for a tree of `width` nodes (root included)."""
    for bucket in WIDTH_BUCKETS:
        if width <= bucket:
            return bucket
    return -(-width // 64) * 64


def rows_bucket(rows: int) -> int:
    """The padded row count for `rows` rows: the next power of two."""
    return 1 << max(int(rows) - 1, 0).bit_length()


def capacity_bucket(capacity: int) -> int:
    """The static cache capacity for `capacity` slots per row."""
    return -(-int(capacity) // CAPACITY_STEP) * CAPACITY_STEP


def resolve_mode(compile: Union[bool, str], device: torch.device, paged: bool) -> Optional[str]:
    """The compile mode `generate(..., compile=compile)` runs with on `device`, or None (eager).

    False: eager. True: "default" (inductor), refused with a paged cache. A mode name (MODES):
    that mode. "auto": eager. On a CPU, measured (docs/loop.md, bench/bench_compiled.py): a
    compiled step of the default model was 1.1-1.4x faster than eager, but each graph took
    over a minute to compile, repaid only after thousands of steps at its shape; on an H200
    "reduce-overhead" made a plain step 7.7x faster, but each graph took ~28 s to compile,
    repaid after ~1,500 steps (docs/gpu.md, the fourth window).
    """
    if compile is False or compile is None:
        return None
    if compile == "auto":
        return None
    if compile is True:
        mode = "default"
    elif isinstance(compile, str) and compile in MODES:
        mode = compile
    else:
        raise ValueError(f"compile: expected False, True, 'auto' or a mode in {list(MODES)}, got {compile!r}")
    if paged:
        raise ValueError("compile: the compiled verify step needs a dense cache; pass kv_page_size=None or compile=False")
    if mode == "reduce-overhead" and device.type != "cuda":
        raise ValueError(f"compile: mode 'reduce-overhead' (CUDA graphs) needs a CUDA device, got {device}")
    return mode


class StaticTreeKVCache(TreeKVCache):
    """A dense `TreeKVCache` whose compiled forwards see fixed shapes.

    The buffers are allocated once for `allocated_rows` rows (a power of two) and the
    rounded-up capacity. The running rows live in the first `rows` entries: eager code (the
    prefill, compaction, the base class's writes) sees views of those rows only, as it would
    see a plain `TreeKVCache`; the compiled forward (`static_forward` on) sees the rows'
    bucket and the whole capacity, writes its tree at `static_seqlens[b] + j` and hands
    attention the whole buffers.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.block_table is not None:
            raise ValueError("StaticTreeKVCache: dense caches only (page_size=None)")
        self.allocated_rows = self.seqlens.shape[0]
        self.mark_static = False  # mark the buffers the graphs read as static addresses (CUDA graphs)
        self.static_forward = False
        self.static_seqlens: Optional[torch.Tensor] = None
        for layer in self.layers:
            layer.k_full, layer.v_full = layer.k_buf, layer.v_buf
        self._use_rows(self.allocated_rows)

    @classmethod
    def for_generate(cls, model, batch_size: int, capacity: int, mark_static: bool = False) -> "StaticTreeKVCache":
        """A cache for `batch_size` rows of at least `capacity` slots, shaped for `model`.
        mark_static: mark the buffers as static addresses (CUDA graphs)."""
        cache = cls.for_model(model, rows_bucket(batch_size), capacity_bucket(capacity))
        cache.mark_static = mark_static
        cache.seqlens = cache.seqlens[:batch_size].contiguous()
        cache._use_rows(batch_size)
        return cache

    @property
    def bucket_rows(self) -> int:
        """Rows the compiled forward runs on: the running rows' bucket."""
        return self.layers[0].k_static.shape[0]

    def _use_rows(self, rows: int) -> None:
        """The first `rows` entries of the buffers are the running rows."""
        bucket = min(rows_bucket(rows), self.allocated_rows)
        for layer in self.layers:
            layer.k_buf, layer.v_buf = layer.k_full[:rows], layer.v_full[:rows]
            layer.keys, layer.values = layer.k_buf.transpose(1, 2), layer.v_buf.transpose(1, 2)
            layer.k_static, layer.v_static = layer.k_full[:bucket], layer.v_full[:bucket]
            if self.mark_static:  # unguarded: a new view of the same memory is no recompile
                torch._dynamo.mark_static_address(layer.k_static)
                torch._dynamo.mark_static_address(layer.v_static)
        self._slots = (rows, self.capacity)
        self._rows = torch.arange(rows, device=self.seqlens.device)[:, None]

    def _reshape_layer(self, layer, key_states, value_states) -> None:
        want_k = (key_states.shape[1], key_states.shape[3])
        want_v = (value_states.shape[1], value_states.shape[3])
        if tuple(layer.k_full.shape[2:]) == want_k and tuple(layer.v_full.shape[2:]) == want_v:
            return
        if self.max_len != 0 or self.static_forward:
            raise ValueError(f"StaticTreeKVCache: a layer wrote keys [H, D] = {list(want_k)} and values "
                             f"{list(want_v)} into buffers of {list(layer.k_full.shape[2:])} / "
                             f"{list(layer.v_full.shape[2:])} after its first forward")
        slots = (self.allocated_rows, self.capacity)
        layer.k_full = torch.zeros(slots + want_k, dtype=layer.dtype, device=layer.device)
        layer.v_full = torch.zeros(slots + want_v, dtype=layer.dtype, device=layer.device)
        self._use_rows(self.seqlens.shape[0])

    def _write(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        if not self.static_forward:
            return super()._write(layer, key_states, value_states)
        # Static: [bucket, H, T, D] states at static_seqlens[b] + j, whole buffers back.
        # (No capacity check here: it would read a host int; `StaticForward` checks before.)
        k_buf, v_buf = layer.k_static, layer.v_static
        rows = torch.arange(k_buf.shape[0], device=k_buf.device)[:, None]
        slots = self.static_seqlens.long()[:, None] + torch.arange(key_states.shape[2], device=k_buf.device)
        k_buf[rows, slots] = key_states.transpose(1, 2).to(k_buf.dtype)
        v_buf[rows, slots] = value_states.transpose(1, 2).to(v_buf.dtype)
        return k_buf.transpose(1, 2), v_buf.transpose(1, 2)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (int64, in the new order): they move to the front of the same
        buffers (one copy of the kept rows, no reallocation)."""
        for layer in self.layers:
            layer.k_full[: rows.numel()] = layer.k_full[rows]
            layer.v_full[: rows.numel()] = layer.v_full[rows]
        self._use_rows(rows.numel())
        self.set_lengths(self.seqlens[rows])

    # transformers' Cache API: in a static forward no size may depend on the host-side lengths.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.static_forward else super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length, layer_idx: int = 0, *args, **kwargs):
        if self.static_forward:
            return self.capacity, 0
        return super().get_mask_sizes(query_length, layer_idx, *args, **kwargs)


def _tree_forward(model, cache, tokens, positions, tree_mask, seqlens, return_hidden):
    """The traced function: one tree forward of `model` on a static `cache` (hf.forward's
    body without its context variable, which dynamo cannot trace; the tree metadata goes
    down as forward kwargs)."""
    args = dict(input_ids=tokens, position_ids=positions, past_key_values=cache, use_cache=True,
                **{TREE_MASK_KWARG: tree_mask, SEQLENS_KWARG: seqlens})
    if not return_hidden:
        return model(logits_to_keep=0, **args).logits.float()
    last, hidden = _hidden(model, args, True)
    return model.get_output_embeddings()(last).float(), hidden


_COMPILED = {}  # mode -> torch.compile(_tree_forward, mode=mode)


def _compiled(mode: str):
    fn = _COMPILED.get(mode)
    if fn is None:
        fn = _COMPILED[mode] = torch.compile(_tree_forward, fullgraph=True, dynamic=False, mode=mode)
    return fn


def _graphs_compiled() -> int:
    """Graphs dynamo has captured in this process (a change means the last call compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StaticForward:
    """The compiled tree forward of one `generate` call: pads each step's tree to the
    buckets, runs the compiled graph on a `StaticTreeKVCache`, and keeps the seconds spent
    compiling (`compile_seconds`, `compiles`) and the steps run compiled (`compiled_steps`).

    Hidden states of chosen layers (`return_hidden` a tuple: drafters with `hidden_layers`)
    need transformers' `output_hidden_states`, whose output capture dynamo cannot trace (it
    enters a lock): those forwards run eagerly on the same cache.

    Args:
        mode: a torch.compile mode (MODES).
    """

    def __init__(self, mode: str):
        self.mode = mode
        self.compile_seconds = 0.0
        self.compiles = 0
        self.compiled_steps = 0

    def cache(self, model, batch_size: int, capacity: int) -> StaticTreeKVCache:
        """The call's KV cache: `capacity` slots per row plus room for padding the widest tree
        (the caller's capacity counts the drafter's widest tree, root included)."""
        # (a tree of W nodes is padded to at most W + 63: width_bucket)
        return StaticTreeKVCache.for_generate(model, batch_size, capacity + 64,
                                              mark_static=self.mode == "reduce-overhead")

    def forward(self, model, cache: StaticTreeKVCache, tokens: torch.Tensor, position_ids: torch.Tensor,
                tree_mask: torch.Tensor, *, return_hidden=False):
        """`hf.forward(model, cache, tokens, position_ids, tree_mask, return_hidden=...)` for a
        tree step, compiled: same results (logits [B, T, V] fp32, and hidden states as asked)."""
        if isinstance(return_hidden, (list, tuple)):  # does not trace (see the class docstring)
            from .hf.attention import forward

            return forward(model, cache, tokens, position_ids, tree_mask, return_hidden=tuple(return_hidden))
        rows, width = tokens.shape
        bucket_rows, bucket_width = cache.bucket_rows, width_bucket(width)
        if int(cache.max_len) + bucket_width > cache.capacity:
            raise ValueError(f"StaticTreeKVCache: {cache.max_len + bucket_width} slots needed but the cache holds "
                             f"{cache.capacity}")
        device = tokens.device
        if (rows, width) == (bucket_rows, bucket_width):  # nothing to pad (e.g. plain decoding of one row)
            pad_tokens, pad_positions = tokens.clamp(min=0).long(), position_ids.long()
            mask = tree_mask if tree_mask.dim() == 3 else tree_mask.expand(rows, -1, -1).contiguous()
            seqlens = cache.seqlens.int()
        else:
            pad_tokens = torch.zeros(bucket_rows, bucket_width, dtype=torch.int64, device=device)
            pad_tokens[:rows, :width] = tokens.clamp(min=0)  # padding nodes (-1) read token 0, as in hf.forward
            pad_positions = torch.zeros(bucket_rows, bucket_width, dtype=torch.int64, device=device)
            pad_positions[:rows, :width] = position_ids
            # Padding nodes and rows see only themselves (a query that sees nothing would be a
            # softmax over nothing); no real node sees them.
            mask = torch.eye(bucket_width, dtype=torch.bool, device=device).repeat(bucket_rows, 1, 1)
            mask[:rows, :width, :width] = tree_mask if tree_mask.dim() == 3 else tree_mask[None]
            seqlens = torch.zeros(bucket_rows, dtype=torch.int32, device=device)
            seqlens[:rows] = cache.seqlens
        hidden = bool(return_hidden)

        graphs = _graphs_compiled()
        start = time.perf_counter()
        cache.static_forward, cache.static_seqlens = True, seqlens
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs were consumed
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=4 * RECOMPILE_LIMIT):
                out = _compiled(self.mode)(model, cache, pad_tokens, pad_positions, mask, seqlens, hidden)
        except Exception as error:
            from torch._dynamo.exc import TorchDynamoException
            from torch._inductor.exc import InductorError

            if not isinstance(error, (TorchDynamoException, InductorError)):
                raise
            first_line = (str(error).splitlines() or [""])[0]
            raise CompileError(f"compile: torch.compile failed on the tree forward of {family(model)} "
                               f"({type(error).__name__}: {first_line}); pass compile=False") from error
        finally:
            cache.static_forward, cache.static_seqlens = False, None
        if _graphs_compiled() != graphs:  # this call compiled a graph: all its time was compiling
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        self.compiled_steps += 1
        if self.mode == "reduce-overhead":  # CUDA graph outputs are overwritten by the next replay
            out = out.clone() if hidden is False else tuple(o.clone() for o in out)
        if hidden is False:
            return out[:rows, :width]
        logits, states = out
        return logits[:rows, :width], states[:rows, :width]


class CompileError(RuntimeError):
    """torch.compile could not compile the tree forward (a graph break, an unsupported op)."""


def static_forward(target, compile: Union[bool, str], device: torch.device, paged: bool) -> Optional[StaticForward]:
    """A `StaticForward` for `generate(..., compile=compile)`, or None to run eagerly
    (`resolve_mode`; bad arguments raise ValueError)."""
    mode = resolve_mode(compile, device, paged)
    if mode is None:
        return None
    return StaticForward(mode)
