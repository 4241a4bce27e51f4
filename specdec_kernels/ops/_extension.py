"""Loads the compiled extension `specdec_kernels._C` and routes each op to an implementation.

`_C` defines every op's schema (`TORCH_LIBRARY(specdec, m)`) and registers compiled kernels
for some (op, device) pairs. Here we add, once, a fake (meta) implementation per op so it
traces under torch.compile, and a Python kernel for each (op, device) pair without a compiled
one, so `torch.ops.specdec.<op>` works on every device: on CUDA the Triton kernel where there
is one, `triton` is installed and `config.triton_by_default` is on (read at each call), else
the reference. Without `_C` the package still works: every call runs the Triton kernel (CUDA)
or the reference directly, and we say why once.
"""

import functools
import importlib
import importlib.util
import os
import sys
import warnings

import torch

from .. import config
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



def has_compiled_class(name: str) -> bool:
    """Whether the loaded `_C` registered the torch custom class `specdec.<name>` (the host
    indexes: NgramIndex, SuffixIndex)."""
    if LOAD_ERROR is not None:
        return False
    try:
        getattr(torch.classes.specdec, name)  # raises if _C did not register it
    except (RuntimeError, AttributeError):
        return False
    return True


def host_index_backend(name: str, backend) -> str:
    """The backend of a host index class `name`: None picks "cpu" (the compiled class) when
    `_C` has it, else "python" (its plain-Python reference); a forced "cpu" without it raises."""
    if backend is None:
        return "cpu" if has_compiled_class(name) else "python"
    if backend not in ("cpu", "python"):
        raise ValueError(f"backend: expected None or one of ('cpu', 'python'), got {backend!r}")
    if backend == "cpu" and not has_compiled_class(name):
        raise RuntimeError(
            f"{name}(backend='cpu'): specdec_kernels._C has no compiled {name} "
            f"({LOAD_ERROR or 'the loaded build predates it'}); use backend='python' or rebuild"
        )
    return backend

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
    return getattr(importlib.import_module(f"specdec_kernels.ops.triton.{op}"), op)


def _triton_by_default(op: str) -> bool:
    """Whether CUDA tensors without a compiled kernel for `op` run its Triton kernel now."""
    return op in TRITON_OPS and HAS_TRITON and config.triton_by_default


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_warned_cuda_reference = False


def _warn_cuda_reference(op: str) -> None:
    """Once per process: CUDA tensors are about to run the plain-torch reference of `op`,
    which is correct but slow; say what is missing and how to get the fast path."""
    global _warned_cuda_reference
    if _warned_cuda_reference:
        return
    _warned_cuda_reference = True
    missing, fixes = [], []
    # setup.py compiles the CUDA kernels where torch has CUDA and nvcc is found.
    build = ("where torch has CUDA and nvcc is found (CUDA_HOME or PATH): "
             "pip install --no-build-isolation -e .")
    if _C is None:
        missing.append(f"the compiled extension specdec_kernels._C is unavailable ({LOAD_ERROR})")
        fixes.append(f"build it {build}")
    elif "CUDA" not in COMPILED[op]:
        missing.append("specdec_kernels._C was built without CUDA kernels")
        fixes.append(f"rebuild it {build}")
    if op in TRITON_OPS:
        if not HAS_TRITON:
            missing.append("triton is not installed (its Triton kernel would run instead)")
            fixes.append("pip install triton")
        elif not config.triton_by_default:
            missing.append("its Triton kernel is switched off (config.triton_by_default is False)")
            fixes.append("set specdec_kernels.config.triton_by_default = True (or unset SPECDEC_TRITON_BY_DEFAULT=0)")
    # Point the warning at the user's call, not at this package's frames.
    frame, level = sys._getframe(), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"specdec_kernels: {op} got CUDA tensors and runs the plain-torch reference (correct but slow), "
        f"because {'; and '.join(missing)}. To get the fast kernels: {'; '.join(fixes)}. "
        "(Other ops may fall back too; this warning is shown once per process.)",
        RuntimeWarning,
        stacklevel=level,
    )


def _cuda_python_kernel(op: str):
    """The CUDA kernel registered for `op` when `_C` has no compiled one: it reads
    `config.triton_by_default` at each call, so the setting can change at run time."""
    reference_kernel = getattr(reference, op)

    def kernel(*args):
        if _triton_by_default(op):
            return triton_kernel(op)(*args)
        _warn_cuda_reference(op)
        return reference_kernel(*args)

    kernel.__name__ = f"python_cuda_{op}"
    return kernel


def _register_python_kernels() -> None:
    from . import _fake  # noqa: F401  (registers the fake implementations)

    for op in OPS:
        for key in ("CPU", "CUDA"):
            if key not in COMPILED[op]:
                kernel = _cuda_python_kernel(op) if key == "CUDA" else getattr(reference, op)
                torch.library.register_kernel(f"specdec::{op}", key.lower(), kernel)


if _C is not None:
    _register_python_kernels()


def available_backends(op: str, device_type: str) -> list:
    """Backends that can run `op` on `device_type` ("cpu" / "cuda"), in the order the default
    (backend=None) path prefers them now. A Triton kernel comes after the reference when
    `config.triton_by_default` is off."""
    found = [device_type] if device_type.upper() in COMPILED[op] else []
    has_triton = device_type == "cuda" and op in TRITON_OPS and HAS_TRITON
    if has_triton and config.triton_by_default:
        return found + ["triton", "reference"]
    return found + ["reference"] + (["triton"] if has_triton else [])


# (op, device type, backend, config.triton_by_default) -> the callable that runs it. Filled on
# first use of each combination, so a call looks its kernel up once instead of re-deciding.
_KERNELS: dict = {}


def _resolve(op: str, device_type: str, backend, device: torch.device):
    """The callable that runs `op` on `device_type` tensors with `backend`; raises if none can."""
    if backend is None:
        if device_type.upper() in COMPILED[op] or (_C is not None and device_type not in ("cpu", "cuda")):
            return getattr(torch.ops.specdec, op).default  # compiled kernel (or meta/fake for other devices)
        if device_type == "cuda":
            if _triton_by_default(op):
                return triton_kernel(op)
            _warn_cuda_reference(op)
        # The Python kernel we registered for this key, called directly: no trip through the
        # dispatcher and back into Python.
        return getattr(reference, op)
    if backend == "reference":
        return getattr(reference, op)
    if backend in ("cpu", "cuda"):
        if device_type != backend:
            raise ValueError(f"backend={backend!r} needs {backend} tensors, got tensors on {device}")
        if backend.upper() not in COMPILED[op]:
            why = f" ({LOAD_ERROR})" if LOAD_ERROR else ""
            raise RuntimeError(
                f"backend={backend!r}: specdec_kernels._C has no compiled {backend} kernel for {op}{why}; "
                f"available here: {available_backends(op, device_type)}"
            )
        return getattr(torch.ops.specdec, op).default
    if backend == "triton":
        if op not in TRITON_OPS:
            raise RuntimeError(f"backend='triton': no Triton kernel for {op} in this build")
        if not HAS_TRITON:
            raise RuntimeError(f"backend='triton' for {op} needs the triton package (pip install triton)")
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"backend='triton' for {op} on CPU tensors runs only under the Triton interpreter "
                "(TRITON_INTERPRET=1, for testing); on CPU use backend=None or 'reference'"
            )
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"backend='triton' needs cuda (or, interpreted, cpu) tensors, got tensors on {device}")
        return triton_kernel(op)
    raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")


def dispatch(op: str, backend, like: torch.Tensor, *args):
    """Run `op` on normalised arguments with the chosen backend (None: the best available for
    the device of `like`, the op's leading tensor)."""
    device_type = "cpu" if like.is_cpu else "cuda" if like.is_cuda else like.device.type
    if backend is None and _C is not None and (
        torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or type(like) is not torch.Tensor
    ):
        # Tracing (torch.compile, export), a dispatch mode (fake tensors) or a tensor subclass:
        # go through torch.ops so the op appears as one node with its fake implementation.
        return getattr(torch.ops.specdec, op).default(*args)
    key = (op, device_type, backend, config.triton_by_default)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _resolve(op, device_type, backend, like.device)
        if not (backend == "triton" and device_type == "cpu"):  # depends on TRITON_INTERPRET: re-check
            _KERNELS[key] = kernel
    if (not isinstance(kernel, torch._ops.OpOverload) and not torch.compiler.is_compiling()
            and torch._C._autograd._profiler_enabled()):
        # The reference and Triton kernels are Python functions: while a profiler runs, give them
        # the compiled ops' event name (specdec::<op>), so a profile (bench e2e's kernel share)
        # sees our ops whichever backend ran them; CUDA tensors run these by default.
        with torch.profiler.record_function(f"specdec::{op}"):
            return kernel(*args)
    return kernel(*args)
