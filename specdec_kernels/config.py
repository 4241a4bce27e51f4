"""Settings that change what the ops do at run time (each is read at every call).

check_values: the process-wide default for the input checks that read tensor values (token
    ids in range, parents in topological order, ...). On GPU they cost a device->host sync
    per call; a serving loop that builds its own inputs can turn them off. They are skipped
    automatically under torch.compile and during CUDA-graph capture.

    `value_checks(False)` turns them off inside a `with` block for the current thread (or
    asyncio task) only, without touching the process-wide default: `generate` uses it, since
    it builds every op input itself.

triton_by_default: whether CUDA tensors run the Triton kernels (`tree_attention`, `verify`,
    `tree_attention_paged`) when the compiled extension has no CUDA kernel for the op
    (`backend=None`). On by default: the Triton kernels pass their GPU tests (H200, Triton
    3.6, 2026-11-26). The environment variable SPECDEC_TRITON_BY_DEFAULT=0 at import turns it
    off; set it here at any time instead. Off, such calls run the plain-torch reference.
    `backend="triton"` always forces the Triton kernel, whatever this says.
lean_forward: whether `generate` runs tree steps of Llama, Mistral, Qwen2 and Qwen3 models on a CPU
    through `loop.hf.lean.LeanForward` (transformers' math with fewer ops; bit-identical
    logits) instead of the model's own forward. On by default; SPECDEC_LEAN_FORWARD=0 at import
    turns it off; set it here at any time instead (read when `generate` starts).
fused_layers: whether the lean forward runs each decoder layer as one `decoder_layer` op (C++)
    at the row counts where the target's linears run `small_linear`: the same steps without the
    Python between them, equal to the lean forward with those linears routed up to the order
    of RMSNorm's sum of squares. On by
    default; SPECDEC_FUSED_LAYERS=0 at import turns it off (read when `generate` starts).
huge_pages: whether `generate` moves the large weights of CPU targets and draft models into
    transparent huge pages (`loop.memory.weights_in_huge_pages`: the same values in 2 MB
    pages, which a decoding step streams faster). On by default; SPECDEC_HUGE_PAGES=0 at
    import turns it off (read when `generate` starts).
argmax_head: whether greedy `generate` calls without logits processing take each node's target
    token from the lean forward's `small_linear_argmax` (one byte per LM-head weight: an int8
    copy and exact per-row error bounds, then the exact logits of the few candidates) instead
    of the full logits, at the row counts where that is faster (`LeanForward.greedy_rows`). The
    same tokens bit for bit as the full logits' argmax. On by default; SPECDEC_ARGMAX_HEAD=0 at
    import turns it off (read when `generate` starts).
"""

import contextlib
import contextvars
import os
from typing import Optional

check_values: bool = True

triton_by_default: bool = os.environ.get("SPECDEC_TRITON_BY_DEFAULT", "1") != "0"
lean_forward: bool = os.environ.get("SPECDEC_LEAN_FORWARD", "1") != "0"
fused_layers: bool = os.environ.get("SPECDEC_FUSED_LAYERS", "1") != "0"
huge_pages: bool = os.environ.get("SPECDEC_HUGE_PAGES", "1") != "0"
argmax_head: bool = os.environ.get("SPECDEC_ARGMAX_HEAD", "1") != "0"

_check_values_here: contextvars.ContextVar[Optional[bool]] = contextvars.ContextVar("specdec_check_values", default=None)


def values_checked() -> bool:
    """Whether value checks are on here: the innermost `value_checks` block, else `check_values`."""
    here = _check_values_here.get()
    return check_values if here is None else here


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn value checks on or off inside the block, for this thread / task only."""
    token = _check_values_here.set(bool(enabled))
    try:
        yield
    finally:
        _check_values_here.reset(token)
