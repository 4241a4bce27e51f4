"""What one decoding step costs on this device: the cost model of adaptive speculation.

A step runs one target forward over `rows x width` tokens (every row's tree padded to the
widest, root included) after a prefix of about `prefix` tokens. `CostModel` predicts its
seconds from a few forwards timed on the device at first use:

    seconds(rows, width, prefix) = table(rows * width) + per_key * rows * width * (prefix - P0)

`table` is piecewise linear in the token count through the measured points (a forward is
flat while it reads weights and grows linearly once it computes: both shapes fit), extended
linearly past the last point; `per_key` is the attention's extra cost per query token and
cached key past the calibration prefix P0, from one forward at a long prefix.

On a CPU the calibration first picks how few-row linears run (`small_linear`): it times the
target's fp32 linear weights at 1-32 rows with `F.linear` and with our `small_linear`
kernel, keeps `small_linear_rows` (the range of row counts at which ours won, (0, 0) if
none), and times the table with that choice, which `generate` then runs with.

The measurement is cached on disk per model (name and a hash of the shapes that set its
cost), device and dtype (and CPU thread count), under `models.cache_dir()/cost_models/`. A
file whose identity differs from the model and device at hand, or whose numbers are not
usable, is measured again: a plan is never made from another machine's numbers.

Online refresh: the loop reports each step's measured seconds (which also include drafting,
verification and bookkeeping, and whatever load the machine is under). The model keeps a
decayed ratio measured / predicted per power-of-two bucket of the token count and scales its
predictions by the ratio of the nearest bucket it has seen, so plans follow the loop's real
costs at the shapes it actually runs.
"""

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

# 2: interleaved calibration rounds (files of 1 may hold shapes bent by load); 3: small_linear_rows;
# 4: bf16 small_linear calibrated (older bf16 files never chose it); 5: the AVX-512 fp32
# small_linear kernel and ties no longer breaking its row range (step costs and the range change);
# the identity's "forward": "lean" where `generate` runs loop.hf.lean's forward (cheaper steps),
# "lean+fused" where its layers run as `decoder_layer` ops (cheaper still)
FORMAT = 5
GRID = (1, 2, 4, 8, 16, 32, 64, 128)  # token counts timed at calibration
CAL_PREFIX = 64  # prefix length of the table's forwards
LONG_PREFIX = 1024  # prefix length of the forward that measures the attention term
_DECAY = 0.8  # weight of the old ratio per observed step
_RATIO_RANGE = (0.2, 5.0)  # one step's measured / predicted, clipped (a hiccup must not swing plans)

# One model per (model, device, dtype, threads) in this process, so online corrections carry
# over from one generate call to the next.
_LOADED: Dict[str, "CostModel"] = {}


def model_identity(model) -> dict:
    """What identifies `model`'s forward cost: its name, and a hash of its config's shape
    fields and parameter count (two checkpoints of one architecture cost the same)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    shape = {f: getattr(cfg, f, None) for f in fields}
    shape["parameters"] = sum(p.numel() for p in model.parameters())
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]
    name = getattr(model, "name_or_path", None) or getattr(cfg, "_name_or_path", None) or ""
    return {"model": Path(str(name)).name or type(model).__name__, "config": digest}


def device_identity(device: torch.device) -> str:
    """The device as it matters for timings: GPU name and capability, or CPU model and threads."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda:{torch.cuda.get_device_name(index)}:sm{major}{minor}"
    cpu = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device.type}:{cpu}:threads={torch.get_num_threads()}"


def lean_kind() -> str:
    """How the lean forward runs its layers: "lean+fused" where each runs as one `decoder_layer`
    op (at small_linear's row counts), else "lean" (op by op)."""
    from .. import config
    from ..ops import decoder_layer

    return "lean+fused" if config.fused_layers and decoder_layer.has_kernel() else "lean"


def hf_lean_applies(model) -> bool:
    """Whether `generate` runs `model`'s tree steps through `loop.hf.lean.LeanForward`."""
    try:
        from .hf.lean import unsupported_reason
    except ImportError:  # no transformers: not a transformers model
        return False
    return unsupported_reason(model) is None


def identity(model) -> dict:
    """The key a cost measurement is valid for (model, device, dtype, format, and the backend
    tree attention runs on that device: on a GPU the reference, Triton and CUDA kernels cost
    very differently, so a table measured with one is not reused with another)."""
    from ..ops import _extension

    param = next(model.parameters())
    device_type = "cpu" if param.is_cpu else param.device.type
    backends = _extension.available_backends("tree_attention", device_type)
    return {**model_identity(model), "device": device_identity(param.device), "dtype": str(param.dtype).replace("torch.", ""),
            "format": FORMAT, "attention": backends[0],  # (the default backend: triton_by_default counts)
            **({"forward": lean_kind()} if hf_lean_applies(model) else {})}


class CostModel:
    """Predicted seconds of one decoding step (see the module docstring).

    Args:
        key: the identity the numbers were measured for (`identity(model)`).
        tokens: increasing token counts (>= 1) of the timed forwards.
        seconds: their measured seconds (> 0, finite).
        per_key: attention seconds per (query token x cached key) past `prefix` (>= 0).
        prefix: the prefix length the table was measured at.
        small_linear_rows: (lo, hi): the target's linears run as `small_linear.small_linears(target,
            small_linear_rows)` (the table was timed so; (0, 0): plain `F.linear`).
    """

    def __init__(self, key: dict, tokens: Sequence[int], seconds: Sequence[float], per_key: float = 0.0,
                 prefix: int = CAL_PREFIX, small_linear_rows: Sequence[int] = (0, 0)):
        tokens, seconds = [float(t) for t in tokens], [float(s) for s in seconds]
        if len(tokens) < 2 or len(tokens) != len(seconds):
            raise ValueError(f"tokens, seconds: expected two or more measured points of each, got {len(tokens)} and {len(seconds)}")
        if tokens[0] < 1 or any(b <= a for a, b in zip(tokens, tokens[1:])):
            raise ValueError(f"tokens: expected increasing counts >= 1, got {tokens}")
        if not all(math.isfinite(s) and s > 0 for s in seconds):
            raise ValueError(f"seconds: expected finite times > 0, got {seconds}")
        if not (math.isfinite(per_key) and per_key >= 0):
            raise ValueError(f"per_key: expected a finite value >= 0, got {per_key}")
        lo, hi = (int(r) for r in small_linear_rows)
        if not ((lo, hi) == (0, 0) or 1 <= lo <= hi):
            raise ValueError(f"small_linear_rows: expected (0, 0) or 1 <= lo <= hi, got {tuple(small_linear_rows)}")
        self.key, self.prefix, self.per_key = dict(key), int(prefix), float(per_key)
        self.small_linear_rows = (lo, hi)
        self.tokens = torch.tensor(tokens, dtype=torch.float64)
        self.seconds = torch.tensor(seconds, dtype=torch.float64)
        slopes = (self.seconds[1:] - self.seconds[:-1]) / (self.tokens[1:] - self.tokens[:-1])
        self._slopes = torch.cat([slopes, slopes[-1:].clamp(min=0)])  # past the last point: its slope, never falling
        self._ratio = torch.ones(64, dtype=torch.float64)  # per log2 bucket of the token count
        self._seen = torch.zeros(64, dtype=torch.bool)

    # ------------------------------------------------------------------ predictions

    def forward_seconds(self, tokens: torch.Tensor, prefix: float = CAL_PREFIX) -> torch.Tensor:
        """float64 seconds of target forwards over `tokens` (a tensor of counts) at `prefix`, as
        calibrated (no online correction)."""
        n = tokens.to(torch.float64).clamp(min=1.0)
        seg = (torch.searchsorted(self.tokens, n, right=True) - 1).clamp(min=0)
        base = self.seconds[seg] + self._slopes[seg] * (n - self.tokens[seg]).clamp(min=0)
        return (base + self.per_key * n * (float(prefix) - self.prefix)).clamp(min=self.seconds[0] * 0.5)

    def step_seconds(self, rows: int, widths: torch.Tensor, prefix: float, corrected: bool = True) -> torch.Tensor:
        """float64 seconds of steps of `rows` rows whose trees are `widths` nodes wide (root
        included; a tensor), corrected by what the loop measured (see `observe`) unless
        `corrected` is False (the calibration alone: the same answer every time)."""
        tokens = rows * widths.to(torch.float64)
        seconds = self.forward_seconds(tokens, prefix)
        return seconds * self._correction(tokens) if corrected else seconds

    def _correction(self, tokens: torch.Tensor) -> torch.Tensor:
        bucket = torch.log2(tokens.clamp(min=1)).round().long().clamp(max=63)
        if not bool(self._seen.any()):
            return torch.ones_like(tokens)
        seen = self._seen.nonzero()[:, 0]
        nearest = seen[(bucket[:, None] - seen[None, :]).abs().argmin(1)]
        return self._ratio[nearest]

    def observe(self, rows: int, width: int, prefix: float, seconds: float) -> None:
        """Refresh from one step the loop measured: `rows` rows, trees `width` wide, `seconds`."""
        if rows <= 0 or width <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        tokens = torch.tensor([float(rows * width)], dtype=torch.float64)
        ratio = min(max(seconds / float(self.forward_seconds(tokens, prefix)[0]), _RATIO_RANGE[0]), _RATIO_RANGE[1])
        b = min(int(round(math.log2(rows * width))), 63)
        # A bucket starts from the calibration (ratio 1): one odd step moves it a fifth of the way.
        self._ratio[b] = _DECAY * (float(self._ratio[b]) if self._seen[b] else 1.0) + (1 - _DECAY) * ratio
        self._seen[b] = True

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        return {"key": self.key, "tokens": self.tokens.tolist(), "seconds": self.seconds.tolist(),
                "per_key": self.per_key, "prefix": self.prefix, "small_linear_rows": list(self.small_linear_rows)}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(data["key"], data["tokens"], data["seconds"], data.get("per_key", 0.0), data.get("prefix", CAL_PREFIX),
                   data.get("small_linear_rows", (0, 0)))

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, expected_key: dict) -> "CostModel":
        """Read a cached measurement; ValueError if it is unreadable or measured for another
        model, device or dtype than `expected_key`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cost model file {path}: unreadable ({error})") from error
        if not isinstance(data, dict) or data.get("key") != expected_key:
            got = data.get("key") if isinstance(data, dict) else None
            raise ValueError(f"cost model file {path}: measured for {got}, not {expected_key}")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"cost model file {path}: unusable ({error})") from error

    @classmethod
    def for_model(cls, model, *, path: Optional[Path] = None, verbose: bool = True) -> "CostModel":
        """The cost model of `model` on its device and dtype: from this process, else from the
        cache file, else measured now (a few seconds, with a progress line) and cached.

        Under tensor parallelism (see `tensor_parallel`) every rank must plan the same trees,
        or the ranks' forwards would run different shapes and their collectives would not
        match: the ranks measure together when any of them lacks a usable file (the
        calibration's forwards are collective), and all take rank 0's numbers.
        """
        key = identity(model)
        name = json.dumps(key, sort_keys=True)
        if path is None and name in _LOADED:
            return _LOADED[name]
        path = Path(path) if path is not None else default_path(key)
        parallel = tensor_parallel(model)
        try:
            cost, error = cls.load(path, key), None
        except ValueError as load_error:
            cost, error = None, load_error
        measure = cost is None
        if parallel:  # one rank lacking a usable file makes every rank measure
            measure = not _all_ranks_have(not measure, model)
        if measure:
            if error is not None and path.exists() and verbose:
                print(f"specdec: {error}; measuring again", file=sys.stderr)
            cost = calibrate(model, verbose=verbose)
            if not parallel or torch.distributed.get_rank() == 0:
                try:
                    cost.save(path)
                except OSError as save_error:  # a read-only cache only costs the next process a calibration
                    if verbose:
                        print(f"specdec: could not cache the cost model at {path} ({save_error})", file=sys.stderr)
        if parallel:
            cost = _from_rank0(cost, model)
        _LOADED[name] = cost
        return cost


def tensor_parallel(model) -> bool:
    """Whether `model` is sharded over the ranks of torch.distributed's default group
    (transformers' tensor parallelism sets `model.tp_size`)."""
    return ((getattr(model, "tp_size", None) or 1) > 1 and torch.distributed.is_available()
            and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)


def _collective_device(model) -> torch.device:
    """Where collectives' tensors live: the model's device for NCCL, else the CPU."""
    backend = torch.distributed.get_backend()
    return next(model.parameters()).device if backend == "nccl" else torch.device("cpu")


def _all_ranks_have(ok: bool, model) -> bool:
    """True on every rank iff `ok` is true on every rank."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_collective_device(model))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _from_rank0(cost: "CostModel", model) -> "CostModel":
    """Rank 0's table on every rank (same grid everywhere: the calibration's or the file's)."""
    numbers = torch.tensor(cost.seconds.tolist() + [cost.per_key], dtype=torch.float64,
                           device=_collective_device(model))
    torch.distributed.broadcast(numbers, src=0)
    numbers = numbers.cpu().tolist()
    return CostModel(cost.key, cost.tokens.tolist(), numbers[:-1], numbers[-1], cost.prefix, cost.small_linear_rows)


def default_path(key: dict) -> Path:
    """Where the measurement for `key` is cached."""
    from ..models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["model"])[:60]
    return cache_dir() / "cost_models" / f"{safe}-{key['dtype']}-{digest}.json"


def device_clock(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (CUDA: synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _time_forward(forward, model, cache, num_tokens: int, prefix: int) -> float:
    """Seconds of one `forward` (`hf.tree_step_forward(model)`: what `generate` runs) of a
    `num_tokens` chain after `prefix` cached tokens (the cache's contents do not change the
    cost; nothing is prefilled)."""
    from ..ops.tree import tree_mask

    device = cache.seqlens.device
    tokens = torch.zeros(1, num_tokens, dtype=torch.int64, device=device)  # any ids cost the same
    depth = torch.arange(num_tokens, device=device)
    mask = tree_mask(depth[None, :] - 1)
    cache.set_lengths(torch.tensor([prefix], device=device))
    start = device_clock(device)
    forward(model, cache, tokens, prefix + depth[None, :], mask)
    return device_clock(device) - start


@torch.inference_mode()
def calibrate(model, *, grid: Sequence[int] = GRID, prefix: int = CAL_PREFIX, long_prefix: int = LONG_PREFIX,
              repeats: int = 3, verbose: bool = True) -> CostModel:
    """Measure `model`'s forward on its device: a chain forward per token count in `grid` at
    `prefix`, and one at `long_prefix` for the attention term, after a warm-up.

    The points are timed in `repeats` interleaved rounds (every size once per round) and each
    keeps its best time. What the planner needs is the table's shape (how much a wider step
    costs over a narrower one); timing each size back to back would let a busy spell of the
    machine (other processes) land on some sizes only and bend that shape, while rounds spread
    it over all of them and the minimum drops most of it.

    On a CPU (not tensor-parallel) the choice of few-row linears comes first
    (`small_linear.choose_small_linear_rows` on the target's weights) and the table is timed with it.
    """
    from .. import config
    from . import hf
    from ..ops import small_linear

    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_positions = getattr(cfg, "max_position_embeddings", None) or (long_prefix + max(grid) + 1)
    long_prefix = min(long_prefix, max_positions - max(grid) - 1)
    prefix = min(prefix, max(long_prefix, 0))
    start = time.perf_counter()
    if verbose:
        print(f"specdec: measuring the target forward on this device (once per model, device and dtype) ...",
              end="", file=sys.stderr, flush=True)
    on_cpu = next(model.parameters()).device.type == "cpu" and not tensor_parallel(model)
    with hf.use_tree_attention(model), config.value_checks(False):
        cache = hf.TreeKVCache.for_model(model, 1, max(prefix, long_prefix) + max(grid) + 1)
        rows = small_linear.choose_small_linear_rows(small_linear.linear_weights(model), repeats=repeats) if on_cpu else (0, 0)
        forward = hf.tree_step_forward(model, rows)
        with small_linear.small_linears(model, rows):
            _time_forward(forward, model, cache, grid[0], prefix)  # warm-up (first-call allocations)
            seconds, per_key = _time_table(forward, model, cache, grid, prefix, long_prefix, repeats)
    # The table must not fall. Noise (other processes, interrupts) only ever adds time and
    # the best of a few runs removes most of it, so where a smaller forward measured slower
    # than a larger one, the smaller one is the outlier: cap each point by the points after it
    # (a running max would instead spread one slow small forward to every larger size).
    seconds = torch.tensor(seconds).flip(0).cummin(0).values.flip(0).tolist()
    if verbose:
        layout = f"; linears of {rows[0]}-{rows[1]} rows by our kernel" if rows != (0, 0) else ""
        print(f" {time.perf_counter() - start:.1f} s{layout}", file=sys.stderr)
    return CostModel(identity(model), grid, seconds, per_key, prefix, rows)


def _time_table(forward, model, cache, grid, prefix, long_prefix, repeats):
    """Best-of-`repeats` seconds per token count of `grid` (interleaved rounds), and the
    attention term per (query token x key) from a probe at both prefixes."""
    probe = min(8, max(grid))
    use_long = long_prefix > prefix + 64
    seconds = [math.inf] * len(grid)
    short = long = math.inf
    for _ in range(repeats):
        for i, n in enumerate(grid):
            seconds[i] = min(seconds[i], _time_forward(forward, model, cache, n, prefix))
        if use_long:  # the attention term: the probe at both prefixes, in the same round
            short = min(short, _time_forward(forward, model, cache, probe, prefix))
            long = min(long, _time_forward(forward, model, cache, probe, long_prefix))
    per_key = max(long - short, 0.0) / (probe * (long_prefix - prefix)) if use_long else 0.0
    return seconds, per_key
