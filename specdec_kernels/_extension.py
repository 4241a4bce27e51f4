"""Loads the compiled extension `specdec_kernels._C` and routes each op to an implementation.

`_C` defines every op's schema (`TORCH_LIBRARY(specdec, m)`) and registers compiled kernels
for some (op, device) pairs. Here we add, once, a fake (meta) implementation per op so it
traces under torch.compile, and the reference implementation for each (op, device) pair
without a compiled kernel, so `torch.ops.specdec.<op>` works on every device: on CUDA the
Triton kernel where there is one and `triton` is installed (imported on first use), else the
reference. Without `_C` the package still works: every call runs the Triton kernel (CUDA) or
the reference directly, and we say why once.
"""

import functools
import importlib
import importlib.util
import os
import warnings

import torch

from . import reference

OPS = (
    "tree_mask",
    "pack_tree_mask",
    "tree_attention",
    "verify",
    "compact_kv_cache_",
    "ngram_propose",
    "ngram_propose_tree",
    "tree_attention_paged",
    "compact_kv_cache_paged_",
)
BACKENDS = ("reference", "cpu", "cuda", "triton")
TRITON_OPS = frozenset({"tree_attention", "verify", "tree_attention_paged"})  # ops with a kernel in specdec_kernels/triton/<op>.py
HAS_TRITON = importlib.util.find_spec("triton") is not None  # without importing it
# The Triton kernels have only run in the interpreter, never on a GPU: until a GPU run has
# checked them, CUDA tensors use them by default only when this is set (backend="triton"
# always forces them).
TRITON_BY_DEFAULT = HAS_TRITON and os.environ.get("SPECDEC_ENABLE_UNVERIFIED_TRITON") == "1"


def _load_extension():
    """(module, None) or (None, why it is unavailable)."""
    if importlib.util.find_spec("specdec_kernels._C") is None:
        return None, "it was not built"
    try:
        return importlib.import_module("specdec_kernels._C"), None  # registers torch.ops.specdec.*
    except (ImportError, OSError) as error:  # e.g. built against another torch: undefined symbols
        return None, f"it failed to load: {type(error).__name__}: {error}"


_C, LOAD_ERROR = _load_extension()
if _C is None:
    warnings.warn(
        "specdec_kernels: the compiled extension specdec_kernels._C is unavailable "
        f"({LOAD_ERROR}); every op runs the plain-torch `reference` backend. Build it with "
        "`pip install --no-build-isolation -e .` against the installed torch.",
        RuntimeWarning,
        stacklevel=2,
    )


def _compiled_keys(op: str) -> frozenset:
    """Dispatch keys ("CPU", "CUDA") for which `_C` registered a compiled kernel of `op`."""
    if _C is None:
        return frozenset()
    name = f"specdec::{op}"
    return frozenset(k for k in ("CPU", "CUDA") if torch._C._dispatch_has_kernel_for_dispatch_key(name, k))


COMPILED = {op: _compiled_keys(op) for op in OPS}


@functools.lru_cache(maxsize=None)
def triton_kernel(op: str):
    """The Triton implementation of `op` (imports triton and the kernel module on first use)."""
    return getattr(importlib.import_module(f"specdec_kernels.triton.{op}"), op)


def _lazy_triton_kernel(op: str):
    def kernel(*args):
        return triton_kernel(op)(*args)

    kernel.__name__ = f"triton_{op}"
    return kernel


def _register_python_kernels() -> None:
    from . import _fake  # noqa: F401  (registers the fake implementations)

    for op in OPS:
        for key in ("CPU", "CUDA"):
            if key not in COMPILED[op]:
                if key == "CUDA" and op in TRITON_OPS and TRITON_BY_DEFAULT:
                    kernel = _lazy_triton_kernel(op)
                else:
                    kernel = getattr(reference, op)
                torch.library.register_kernel(f"specdec::{op}", key.lower(), kernel)


if _C is not None:
    _register_python_kernels()


def available_backends(op: str, device_type: str) -> list:
    """Backends that can run `op` on `device_type` ("cpu" / "cuda"), in the order the default
    (backend=None) path prefers them. An unverified Triton kernel comes after the reference
    unless SPECDEC_ENABLE_UNVERIFIED_TRITON=1."""
    found = [device_type] if device_type.upper() in COMPILED[op] else []
    has_triton = device_type == "cuda" and op in TRITON_OPS and HAS_TRITON
    if has_triton and TRITON_BY_DEFAULT:
        return found + ["triton", "reference"]
    return found + ["reference"] + (["triton"] if has_triton else [])


def run(op: str, backend, device: torch.device, *args):
    """Run `op` on normalised arguments with the chosen backend (None: the best available)."""
    if backend is None:
        if _C is None:
            if available_backends(op, device.type)[0] == "triton":
                return triton_kernel(op)(*args)
            return getattr(reference, op)(*args)
        return getattr(torch.ops.specdec, op).default(*args)
    if backend == "reference":
        return getattr(reference, op)(*args)
    if backend in ("cpu", "cuda"):
        if device.type != backend:
            raise ValueError(f"backend={backend!r} needs {backend} tensors, got tensors on {device}")
        if backend.upper() not in COMPILED[op]:
            why = f" ({LOAD_ERROR})" if LOAD_ERROR else ""
            raise RuntimeError(
                f"backend={backend!r}: specdec_kernels._C has no compiled {backend} kernel for {op}{why}; "
                f"available here: {available_backends(op, device.type)}"
            )
        return getattr(torch.ops.specdec, op).default(*args)
    if backend == "triton":
        if op not in TRITON_OPS:
            raise RuntimeError(f"backend='triton': no Triton kernel for {op} in this build")
        if not HAS_TRITON:
            raise RuntimeError(f"backend='triton' for {op} needs the triton package (pip install triton)")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"backend='triton' for {op} on CPU tensors runs only under the Triton interpreter "
                "(TRITON_INTERPRET=1, for testing); on CPU use backend=None or 'reference'"
            )
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs cuda (or, interpreted, cpu) tensors, got tensors on {device}")
        return triton_kernel(op)(*args)
    raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
