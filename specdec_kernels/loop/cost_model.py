"""What one decoding step costs on this device: the cost model of adaptive speculation.

A step drafts (unless the planner skips drafting), then runs one target forward over
`rows x width` tokens (every row's tree padded to the widest, root included) after a prefix
of about `prefix` tokens. Two measured parts predict its seconds:

    seconds = forward(rows, width) + per_key * rows * width * (prefix - P0) + drafting(rows, nodes)

`CostModel` is the target's forward. It is timed at first use on batches of 1, 2, 4 and 8
rows (`ROWS`), each at every tree width up to 8 tokens in all, then at doubling widths up to
128 tokens (`table_widths`), so a step of R rows
x W nodes is read from what such steps measured: at 8 rows one node per row costs ~25%
more than a 1-row chain of 8 tokens (each row attends to its own prefix and carries its
own bookkeeping), which a table of 1-row chains read at R * W tokens missed. Each row
count's table is piecewise linear in the width through its measured points (a forward is
flat while it reads weights and grows linearly once it computes), extended with its last
slope; row counts between two measured ones interpolate linearly, and beyond the measured
ones the nearest table is read at the same token count. `per_key` is the attention's extra
cost per query token and cached key past the calibration prefix P0, from a 1-row forward
at a long prefix.

`DraftCost` is the drafter's part: seconds of one `propose` by rows and drafted nodes (the
budget the planner gives the widest row), timed on the drafter itself at first use (a twin
of it, `Drafter.cost_twin`, on made-up rows of random tokens, so the drafter's own state is
untouched) at the same row counts. Plain decoding pays nothing for drafting; the planner
adds the drafting cost to every step that drafts, so a drafter whose accepted tokens do not
repay it is left idle. It is keyed by the target's identity and the drafter's
(`Drafter.cost_identity`: its kind, sizes and models, never object ids).

On a CPU the target's calibration first picks how few-row linears run (`small_linear`): it
times the target's fp32 linear weights at 1-32 rows with `F.linear` and with our
`small_linear` kernel, keeps `small_linear_rows` (the range of row counts at which ours won,
(0, 0) if none), and times the tables with that choice, which `generate` then runs with.

Both measurements are cached on disk per model (name and a hash of the shapes that set its
cost), device and dtype (and CPU thread count), and for the drafter per drafter identity,
under `models.cache_dir()/cost_models/`. A file whose identity differs from the model,
drafter and device at hand, or whose numbers are not usable, is measured again: a plan is
never made from another machine's numbers. Calls that sample plan from these files alone,
so the same seed gives the same trees in every process that reads them.

Online refresh (greedy calls only): the loop reports each step's measured seconds (drafting,
verification and bookkeeping, under whatever load the machine is) and, of those, the seconds
its drafter's `propose` took. Each part corrects its own model. `DraftCost` keeps a decayed
ratio measured / calibrated of the drafting (per drafter: it is keyed by the drafter's
identity) and scales its predictions by it; `CostModel` keeps a decayed ratio measured /
predicted of the rest of the step per power-of-two bucket of the token count and scales the
forward's predictions by the ratio of the nearest bucket it has seen, so plans follow the
loop's real costs at the shapes it actually runs. Apart, because inside the loop drafting ran
~1.3-1.6x what the drafter's calibration measured on its own (its weights and code cold after
every target forward) while the forward ran near its own: one ratio over both (the rule until
the eighteenth session) carried the drafting's excess into every width, plain steps
included, which a drafting step's bucket was the nearest seen for (docs/loop.md).
"""

import copy
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

# 2: interleaved calibration rounds (files of 1 may hold shapes bent by load); 3: small_linear_rows;
# 4: bf16 small_linear calibrated (older bf16 files never chose it); 5: the AVX-512 fp32
# small_linear kernel and ties no longer breaking its row range (step costs and the range change);
# 6: a table per row count (steps of R rows timed as such, not read from 1-row chains);
# the identity's "forward": "lean" where `generate` runs loop.hf.lean's forward (cheaper steps),
# "lean+fused" where its layers run as `decoder_layer` ops (cheaper still); 7: small_linear passes share
# out the weight prefetches (products of 8+ rows 1.2-1.7x faster), small_linear_rows measured up to 64 rows,
# the fused layers past that range with their products on torch's BLAS (`blas_rows`); 8: the
# small_linear range extended down through near-ties (a file of 7 calibrated under load could
# leave 1-row steps on F.linear: plain decoding 1.6x slower there on an AVX2 machine); 9: the AVX2
# small_linear kernels for 1 and 3-row blocks and the tree attention's 8-float blocks (AVX2 step
# costs changed); 10: the AVX2 packed-panel small_linear kernel for 8 and 11+ rows (batch and
# verify steps 1.2-1.5x cheaper in their products), small_linear_rows measured up to 128 rows; 11: on AMD
# CPUs with AVX-512 fp32 products of 1-2 rows and bf16 products of 1-4 rows stream one weight row at a
# time (plain fp32 steps ~1.25x and bf16 steps ~1.4x cheaper: the tables' shape changes); 12: greedy
# steps' LM head from an int8 copy (`small_linear_argmax`, now bf16 heads too: ~1 ms off a step of up to
# 7-8 rows) and tree attention's next tile prefetched; 13: the AVX-512 stream feeds each weight row to all
# of its 1-4 input rows in one block, and fp32 streams 3-4 rows too (fp32 steps of 2-4 rows cheaper); 14: the
# tables time every width up to DENSE_TOKENS tokens; 15: the AVX-512 stream takes 3-8 rows in blocks of 3 weight
# rows prefetched into L2 (steps of 3-8 tokens cheaper)
FORMAT = 15
DRAFT_FORMAT = 5  # of `DraftCost` files (their key holds the target's identity, FORMAT included); 2: merged drafters judge their sources (SourceJudge), one merge in HeadNgramDrafter; 3: head layers as one decoder_layer op on a CPU; 4: a head's logits for a batch as one product; 5: the heads' trees built on the host (numpy), their norms as rms_norm ops
# 4: a head's strided logits as one product (batches of 4+ rows drafted 4-10x faster)
ROWS = (1, 2, 4, 8)  # batch sizes timed at calibration (the target's forward and the drafter)
MAX_TOKENS = 128  # the target's tables: widths up to rows * width <= MAX_TOKENS (`table_widths`)
# The tables time every width up to this many tokens (rows x width), and double it from there:
# the products change kernels at small row counts, which a line between powers of two misses
# (on AMD's AVX-512 they stream 1-4 rows and take 4 x 4 blocks from 5: a bf16 forward of a
# 5-node chain cost 19.4 ms against 13.9 for 4 and 23.5 for 8, where the line from 4 to 8 says 16.3).
DENSE_TOKENS = 8
CAL_PREFIX = 64  # prefix length of the tables' forwards and of the drafter's made-up rows
LONG_PREFIX = 1024  # prefix length of the forward that measures the attention term
_DECAY = 0.8  # weight of the old ratio per observed step
_RATIO_RANGE = (0.2, 5.0)  # one step's measured / predicted, clipped (a hiccup must not swing plans)

# One measurement per key in this process (`CostModel` per model, device, dtype and threads;
# `DraftCost` per target and drafter), so online corrections carry over from one generate
# call to the next.
_LOADED: Dict[str, "_Measured"] = {}


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


def shapes_digest(module) -> str:
    """A hash of `module`'s parameter names, shapes and dtypes (what its compute depends on,
    not its values): identifies a draft head's cost."""
    shapes = [(name, list(p.shape), str(p.dtype)) for name, p in module.named_parameters()]
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]


def cost_identity(drafter) -> dict:
    """`drafter.cost_identity()`, or its class name and size for a drafter written without it
    (duck-typed drafters keep working)."""
    method = getattr(drafter, "cost_identity", None)
    return method() if method is not None else {"drafter": type(drafter).__name__, "max_nodes": int(drafter.max_nodes)}


def cost_twin(drafter):
    """`drafter.cost_twin()`, or a shallow copy for a drafter written without it."""
    method = getattr(drafter, "cost_twin", None)
    return method() if method is not None else copy.copy(drafter)


def draft_identity(target, drafter) -> dict:
    """The key a drafting-cost measurement is valid for: the target's (device, dtype and
    threads included: head drafters run on the target's device with its LM head rows) and
    the drafter's (`cost_identity`)."""
    return {**identity(target), "drafter": cost_identity(drafter), "draft_format": DRAFT_FORMAT}


_NUMPY_DTYPES = {torch.float64: np.float64, torch.int64: np.int64, torch.bool: np.bool_}


def host_array(values, dtype: torch.dtype = torch.float64) -> np.ndarray:
    """A numpy array of `values` (a tensor on any device, an array or a number) in `dtype`
    (float64, int64 or bool): what the planner computes on, on the host."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", dtype).numpy()
    return np.asarray(values, dtype=_NUMPY_DTYPES[dtype])


class _Curve:
    """Piecewise linear through measured points `(x, y)` (x increasing, y finite and > 0):
    flat before the first point; past the last, its last slope (never falling) when
    `extend`, else flat. One point: a constant."""

    def __init__(self, x: Sequence[float], y: Sequence[float], name: str, extend: bool):
        x, y = [float(v) for v in x], [float(v) for v in y]
        if not x or len(x) != len(y):
            raise ValueError(f"{name}: expected one or more measured points, got {len(x)} x and {len(y)} seconds")
        if x[0] < 1 or any(b <= a for a, b in zip(x, x[1:])):
            raise ValueError(f"{name}: expected increasing sizes >= 1, got {x}")
        if not all(math.isfinite(v) and v > 0 for v in y):
            raise ValueError(f"{name}: expected finite seconds > 0, got {y}")
        # numpy float64: the planner asks every step, and a numpy op on a few numbers costs
        # ~1 us where a torch op costs 5-10 us inside the decode loop (20 us on a GPU host)
        self.x = np.array(x, dtype=np.float64)
        self.y = np.array(y, dtype=np.float64)
        slopes = (self.y[1:] - self.y[:-1]) / (self.x[1:] - self.x[:-1])
        last = np.maximum(slopes[-1:], 0.0) if extend and len(x) > 1 else np.zeros(1)
        self._slopes = np.concatenate([slopes, last])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """float64 seconds at sizes `x` (a numpy array)."""
        x = np.asarray(x, dtype=np.float64)
        seg = np.maximum(np.searchsorted(self.x, x, side="right") - 1, 0)
        return self.y[seg] + self._slopes[seg] * np.maximum(x - self.x[seg], 0.0)

    def to_dict(self, x_name: str) -> dict:
        return {x_name: self.x.tolist(), "seconds": self.y.tolist()}


def _tables(tables: Mapping, name: str, extend: bool) -> Dict[int, _Curve]:
    """{rows: (sizes, seconds)} checked, as curves sorted by row count."""
    if not isinstance(tables, Mapping) or not tables:
        raise ValueError(f"{name}: expected {{rows: (sizes, seconds)}} for one or more row counts, got {tables!r}")
    curves = {}
    for rows in sorted(tables):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"{name}: row counts must be ints >= 1, got {rows!r}")
        sizes, seconds = tables[rows]
        curves[rows] = _Curve(sizes, seconds, f"{name}[{rows}]", extend)
    return curves


class _Measured:
    """What `CostModel` and `DraftCost` share: a `key` naming what was measured, the tables
    as a dict (`to_dict` / `from_dict`), and their files."""

    key: dict

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, expected_key: dict):
        """Read a cached measurement; ValueError if it is unreadable or measured for another
        model, drafter, device or dtype than `expected_key`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cost model file {path}: unreadable ({error})") from error
        if not isinstance(data, dict) or data.get("key") != expected_key:
            got = data.get("key") if isinstance(data, dict) else None
            raise ValueError(f"cost model file {path}: measured for {got}, not {expected_key}")
        try:
            return cls.from_dict(data)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"cost model file {path}: unusable ({error})") from error


class CostModel(_Measured):
    """Predicted seconds of the target's forward in a decoding step (see the module docstring).

    Args:
        key: the identity the numbers were measured for (`identity(model)`).
        tables: {rows: (widths, seconds)}: for each measured row count, the tree widths timed
            (increasing, >= 1; two or more) and the seconds of those forwards (> 0, finite).
        per_key: attention seconds per (query token x cached key) past `prefix` (>= 0).
        prefix: the prefix length the tables were measured at.
        small_linear_rows: (lo, hi): the target's linears run as `small_linear.small_linears(target,
            small_linear_rows)` (the tables were timed so; (0, 0): plain `F.linear`).
    """

    def __init__(self, key: dict, tables: Mapping[int, Tuple[Sequence[int], Sequence[float]]], per_key: float = 0.0,
                 prefix: int = CAL_PREFIX, small_linear_rows: Sequence[int] = (0, 0)):
        self.tables = _tables(tables, "tables", extend=True)
        if any(len(curve.x) < 2 for curve in self.tables.values()):
            raise ValueError("tables: expected two or more measured widths per row count")
        if not (math.isfinite(per_key) and per_key >= 0):
            raise ValueError(f"per_key: expected a finite value >= 0, got {per_key}")
        lo, hi = (int(r) for r in small_linear_rows)
        if not ((lo, hi) == (0, 0) or 1 <= lo <= hi):
            raise ValueError(f"small_linear_rows: expected (0, 0) or 1 <= lo <= hi, got {tuple(small_linear_rows)}")
        self.key, self.prefix, self.per_key = dict(key), int(prefix), float(per_key)
        self.small_linear_rows = (lo, hi)
        self.rows = list(self.tables)
        self._floor = 0.5 * min(float(curve.y[0]) for curve in self.tables.values())
        self._ratio = np.ones(64)  # per log2 bucket of the token count
        self._seen = np.zeros(64, dtype=bool)

    # ------------------------------------------------------------------ predictions

    def forward_seconds(self, rows: int, widths: torch.Tensor, prefix: float = CAL_PREFIX) -> torch.Tensor:
        """float64 seconds of target forwards of `rows` rows over trees `widths` (a tensor)
        nodes wide at `prefix`, as calibrated (no online correction)."""
        return torch.from_numpy(self.forward_seconds_np(rows, host_array(widths), prefix))

    def step_seconds(self, rows: int, widths: torch.Tensor, prefix: float, draft_seconds=0.0,
                     corrected: bool = True) -> torch.Tensor:
        """float64 seconds of steps of `rows` rows whose trees are `widths` nodes wide (root
        included; a tensor) and whose drafting took `draft_seconds` (a float, or a tensor like
        `widths`; `DraftCost`), corrected by what the loop measured (see `observe`) unless
        `corrected` is False (the calibration alone: the same answer every time)."""
        seconds = self.step_seconds_np(rows, host_array(widths), prefix, host_array(draft_seconds), corrected)
        return torch.from_numpy(seconds)

    def forward_seconds_np(self, rows: int, widths: np.ndarray, prefix: float = CAL_PREFIX) -> np.ndarray:
        """`forward_seconds` on numpy arrays (the planner's per-step path)."""
        widths = np.maximum(np.asarray(widths, dtype=np.float64), 1.0)
        measured = self.rows
        if rows in self.tables:
            base = self.tables[rows](widths)
        elif rows < measured[0] or rows > measured[-1]:  # the nearest table, at the same token count
            nearest = measured[0] if rows < measured[0] else measured[-1]
            base = self.tables[nearest](widths * rows / nearest)
        else:  # between two measured row counts: linear in the rows
            hi = next(r for r in measured if r > rows)
            lo = max(r for r in measured if r < rows)
            t = (rows - lo) / (hi - lo)
            base = (1 - t) * self.tables[lo](widths) + t * self.tables[hi](widths)
        return np.maximum(base + self.per_key * rows * widths * (float(prefix) - self.prefix), self._floor)

    def step_seconds_np(self, rows: int, widths: np.ndarray, prefix: float, draft_seconds=0.0,
                        corrected: bool = True) -> np.ndarray:
        """`step_seconds` on numpy arrays (the planner's per-step path)."""
        widths = np.asarray(widths, dtype=np.float64)
        forward = self.forward_seconds_np(rows, widths, prefix)
        return (forward * self._correction(rows * widths) if corrected else forward) + draft_seconds

    def _correction(self, tokens: np.ndarray) -> np.ndarray:
        if not self._seen.any():
            return np.ones_like(tokens)
        bucket = np.minimum(np.round(np.log2(np.maximum(tokens, 1.0))).astype(np.int64), 63)
        seen = np.flatnonzero(self._seen)
        nearest = seen[np.abs(bucket[:, None] - seen[None, :]).argmin(1)]
        return self._ratio[nearest]

    def observe(self, rows: int, width: int, prefix: float, seconds: float, draft_seconds: float = 0.0) -> None:
        """Refresh from one step the loop measured: `rows` rows, trees `width` wide, `seconds`
        in all, of which `draft_seconds` were drafting (0: the step drafted nothing; measured
        where the loop measured it, else what `DraftCost` predicts): the rest is the forward's
        and the bookkeeping's, judged against the forward's prediction."""
        if rows <= 0 or width <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        predicted = float(self.forward_seconds_np(rows, np.array([float(width)]), prefix)[0])
        rest = max(seconds - max(float(draft_seconds), 0.0), 0.0)
        ratio = min(max(rest / predicted, _RATIO_RANGE[0]), _RATIO_RANGE[1])
        b = min(int(round(math.log2(rows * width))), 63)
        # A bucket starts from the calibration (ratio 1): one odd step moves it a fifth of the way.
        self._ratio[b] = _DECAY * (float(self._ratio[b]) if self._seen[b] else 1.0) + (1 - _DECAY) * ratio
        self._seen[b] = True

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        return {"key": self.key, "tables": {str(r): c.to_dict("widths") for r, c in self.tables.items()},
                "per_key": self.per_key, "prefix": self.prefix, "small_linear_rows": list(self.small_linear_rows)}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        tables = {int(r): (t["widths"], t["seconds"]) for r, t in data["tables"].items()}
        return cls(data["key"], tables, data["per_key"], data["prefix"], data["small_linear_rows"])

    @classmethod
    def for_model(cls, model, *, path: Optional[Path] = None, verbose: bool = True) -> "CostModel":
        """The cost model of `model` on its device and dtype: from this process, else from the
        cache file, else measured now (seconds, with a progress line) and cached.

        Under tensor parallelism (see `tensor_parallel`) every rank must plan the same trees,
        or the ranks' forwards would run different shapes and their collectives would not
        match: the ranks measure together when any of them lacks a usable file (the
        calibration's forwards are collective), and all take rank 0's numbers.
        """
        return _cached(cls, identity(model), path, lambda: calibrate(model, verbose=verbose), model,
                       collective=True, verbose=verbose)


class DraftCost(_Measured):
    """Seconds of one drafting step (`Drafter.propose`) by row count and drafted nodes (see
    the module docstring).

    Args:
        key: what it was measured for (`draft_identity(target, drafter)`).
        tables: {rows: (nodes, seconds)}: for each measured row count, the budgets the
            drafter was timed with (the most nodes a row may draft; increasing, >= 1) and the
            seconds of those proposals. A drafter that `drafts_for_free` drafts its full size
            whatever the budget: one point, its max_nodes.
    """

    def __init__(self, key: dict, tables: Mapping[int, Tuple[Sequence[int], Sequence[float]]]):
        self.key = dict(key)
        self.tables = _tables(tables, "tables", extend=False)  # no drafter drafts more than its size
        self.rows = list(self.tables)
        self._ratio = 1.0  # measured / calibrated drafting in the loop (`observe`)

    def seconds(self, rows: int, nodes: torch.Tensor) -> torch.Tensor:
        """float64 seconds of drafting up to `nodes` (a tensor) nodes per row for `rows` rows;
        0 where nodes is 0 (the step drafts nothing). Linear in the rows between measured row
        counts, and past the last with the slope of the last two (the smallest table below)."""
        return torch.from_numpy(self.seconds_np(rows, host_array(nodes)))

    def seconds_np(self, rows: int, nodes: np.ndarray, corrected: bool = False) -> np.ndarray:
        """`seconds` on numpy arrays (the planner's per-step path); corrected: scaled by what
        the loop measured (`observe`)."""
        base = self._calibrated_np(rows, nodes)
        return base * self._ratio if corrected else base

    def observe(self, rows: int, nodes: int, seconds: float) -> None:
        """Refresh from one drafting step the loop measured: `rows` rows, up to `nodes` nodes a
        row (the planner's budget for the widest row), `seconds` measured: a decayed ratio
        measured / calibrated that `seconds_np(..., corrected=True)` scales by."""
        predicted = float(self._calibrated_np(rows, np.array([float(nodes)]))[0])
        if predicted <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        ratio = min(max(seconds / predicted, _RATIO_RANGE[0]), _RATIO_RANGE[1])
        self._ratio = _DECAY * self._ratio + (1 - _DECAY) * ratio

    def _calibrated_np(self, rows: int, nodes: np.ndarray) -> np.ndarray:
        nodes = np.asarray(nodes, dtype=np.float64)
        measured = self.rows
        if rows in self.tables or rows < measured[0] or len(measured) == 1:
            base = self.tables[rows if rows in self.tables else measured[0 if rows < measured[0] else -1]](nodes)
        else:
            hi = next((r for r in measured if r > rows), measured[-1])
            lo = max(r for r in measured if r < hi)
            t = (rows - lo) / (hi - lo)  # > 1 past the last row count
            low, high = self.tables[lo](nodes), self.tables[hi](nodes)
            base = low + t * np.maximum(high - low, 0.0) if rows > hi else (1 - t) * low + t * high
        return np.where(nodes > 0, base, 0.0)

    def to_dict(self) -> dict:
        return {"key": self.key, "tables": {str(r): c.to_dict("nodes") for r, c in self.tables.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "DraftCost":
        return cls(data["key"], {int(r): (t["nodes"], t["seconds"]) for r, t in data["tables"].items()})

    @classmethod
    def for_drafter(cls, target, drafter, *, path: Optional[Path] = None, verbose: bool = True) -> "DraftCost":
        """The drafting cost of `drafter` beside `target` on its device: from this process,
        else from the cache file, else measured now (`calibrate_drafter`, with a progress
        line) and cached. Under tensor parallelism every rank takes rank 0's numbers (the
        drafters run no collectives, so each rank measures on its own when it must)."""
        return _cached(cls, draft_identity(target, drafter), path,
                       lambda: calibrate_drafter(target, drafter, verbose=verbose), target,
                       collective=False, verbose=verbose)


def _cached(cls, key: dict, path: Optional[Path], measure, model, *, collective: bool, verbose: bool):
    """The measurement `cls` for `key`: from this process (unless a `path` is given), else
    from the file at `path` (default: `default_path(key)`), else `measure()`, then saved.
    Under tensor parallelism every rank ends with rank 0's numbers; `collective`: measuring
    runs collective forwards, so the ranks measure together when any of them must."""
    name = json.dumps(key, sort_keys=True)
    if path is None and name in _LOADED:
        return _LOADED[name]
    path = Path(path) if path is not None else default_path(key)
    parallel = tensor_parallel(model)
    try:
        cost, error = cls.load(path, key), None
    except ValueError as load_error:
        cost, error = None, load_error
    measure_now = cost is None
    if parallel and collective:  # one rank lacking a usable file makes every rank measure
        measure_now = not _all_ranks_have(not measure_now, model)
    if measure_now:
        if error is not None and path.exists() and verbose:
            print(f"specdec: {error}; measuring again", file=sys.stderr)
        cost = measure()
        if not parallel or torch.distributed.get_rank() == 0:
            try:
                cost.save(path)
            except OSError as save_error:  # a read-only cache only costs the next process a calibration
                if verbose:
                    print(f"specdec: could not cache the cost model at {path} ({save_error})", file=sys.stderr)
    if parallel:
        cost = _from_rank0(cls, cost, model)
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


def _from_rank0(cls, cost: _Measured, model) -> _Measured:
    """Rank 0's measurement on every rank."""
    data = [cost.to_dict()]
    torch.distributed.broadcast_object_list(data, src=0, device=_collective_device(model))
    return cls.from_dict(data[0])


def default_path(key: dict) -> Path:
    """Where the measurement for `key` is cached (a drafter's beside its target's)."""
    from ..models import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["model"])[:60]
    kind = "-draft" if "drafter" in key else ""
    return cache_dir() / "cost_models" / f"{safe}-{key['dtype']}{kind}-{digest}.json"


def device_clock(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (CUDA: synchronize)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _time_forward(forward, model, cache, width: int, prefix: int) -> float:
    """Seconds of one `forward` (`hf.tree_step_forward(model)`: what `generate` runs) of a
    `width`-token chain in every row of `cache` after `prefix` cached tokens (the cache's
    contents do not change the cost; nothing is prefilled)."""
    from ..ops.tree import tree_mask

    device = cache.seqlens.device
    rows = cache.seqlens.shape[0]
    tokens = torch.zeros(rows, width, dtype=torch.int64, device=device)  # any ids cost the same
    depth = torch.arange(width, device=device).expand(rows, -1)
    mask = tree_mask(depth - 1)
    cache.set_lengths(torch.full((rows,), prefix, device=device))
    start = device_clock(device)
    forward(model, cache, tokens, prefix + depth, mask)
    return device_clock(device) - start


def table_widths(rows: int, max_tokens: int = MAX_TOKENS) -> list:
    """The tree widths the calibration times at `rows` rows: every width while rows * width <=
    min(DENSE_TOKENS, max_tokens) (at least 1), then twice the last while rows * width <= max_tokens."""
    widths = list(range(1, max(min(DENSE_TOKENS, max_tokens) // rows, 1) + 1))
    while rows * widths[-1] * 2 <= max_tokens:
        widths.append(widths[-1] * 2)
    return widths


@torch.inference_mode()
def calibrate(model, *, rows: Sequence[int] = ROWS, max_tokens: int = MAX_TOKENS, prefix: int = CAL_PREFIX,
              long_prefix: int = LONG_PREFIX, repeats: int = 3, verbose: bool = True) -> CostModel:
    """Measure `model`'s forward on its device: for each row count in `rows`, a forward with a
    chain of each width of `table_widths(rows, max_tokens)` per row at `prefix`, and a
    `rows[0]`-row forward at `long_prefix` for the attention term, after a warm-up.

    The points are timed in `repeats` interleaved rounds (every shape once per round) and
    each keeps its best time. What the planner needs is the tables' shape (how much a wider
    step costs over a narrower one); timing each shape back to back would let a busy spell
    of the machine (other processes) land on some shapes only and bend that shape, while
    rounds spread it over all of them and the minimum drops most of it.

    On a CPU (not tensor-parallel) the choice of few-row linears comes first
    (`small_linear.choose_small_linear_rows` on the target's weights) and the tables are timed with it.
    """
    from .. import config
    from . import hf
    from ..ops import small_linear

    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    rows = sorted(int(r) for r in rows)
    if not rows or rows[0] < 1 or max_tokens < 2 * rows[-1]:
        raise ValueError(f"rows, max_tokens: expected row counts >= 1 and max_tokens >= 2 * the largest "
                         f"(two widths each), got {rows} and {max_tokens}")
    widths = {r: table_widths(r, max_tokens) for r in rows}
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_positions = getattr(cfg, "max_position_embeddings", None) or (long_prefix + max_tokens + 1)
    long_prefix = min(long_prefix, max_positions - max_tokens - 1)
    prefix = min(prefix, max(long_prefix, 0))
    start = time.perf_counter()
    if verbose:
        print(f"specdec: measuring the target forward on this device (once per model, device and dtype) ...",
              end="", file=sys.stderr, flush=True)
    on_cpu = next(model.parameters()).device.type == "cpu" and not tensor_parallel(model)
    with hf.use_tree_attention(model), config.value_checks(False):
        # One cache per row count; the first also holds the long prefix of the attention probe.
        caches = {r: hf.TreeKVCache.for_model(model, r, (max(prefix, long_prefix) if r == rows[0] else prefix)
                                              + widths[r][-1] + 1) for r in rows}
        linear_rows = small_linear.choose_small_linear_rows(small_linear.linear_weights(model), repeats=repeats) \
            if on_cpu else (0, 0)
        forward = hf.tree_step_forward(model, linear_rows)  # what generate will run
        with small_linear.small_linears(model, linear_rows):
            _time_forward(forward, model, caches[rows[0]], 1, prefix)  # warm-up (first-call allocations)
            seconds, per_key = _time_tables(forward, model, caches, widths, prefix, long_prefix, repeats)
    # A table must not fall. Noise (other processes, interrupts) only ever adds time and
    # the best of a few runs removes most of it, so where a narrower forward measured slower
    # than a wider one, the narrower one is the outlier: cap each point by the points after it
    # (a running max would instead spread one slow small forward to every larger size).
    tables = {r: (widths[r], torch.tensor(s).flip(0).cummin(0).values.flip(0).tolist()) for r, s in seconds.items()}
    if verbose:
        layout = f"; linears of {linear_rows[0]}-{linear_rows[1]} rows by our kernel" if linear_rows != (0, 0) else ""
        print(f" {time.perf_counter() - start:.1f} s{layout}", file=sys.stderr)
    return CostModel(identity(model), tables, per_key, prefix, linear_rows)


def _time_tables(forward, model, caches, widths, prefix, long_prefix, repeats):
    """Best-of-`repeats` seconds per row count and width (interleaved rounds), and the
    attention term per (query token x key) from a probe at both prefixes."""
    first = min(caches)
    probe = min(8, widths[first][-1])
    use_long = long_prefix > prefix + 64
    seconds = {r: [math.inf] * len(w) for r, w in widths.items()}
    short = long = math.inf
    for _ in range(repeats):
        for r, ws in widths.items():
            for i, w in enumerate(ws):
                seconds[r][i] = min(seconds[r][i], _time_forward(forward, model, caches[r], w, prefix))
        if use_long:  # the attention term: the probe at both prefixes, in the same round
            short = min(short, _time_forward(forward, model, caches[first], probe, prefix))
            long = min(long, _time_forward(forward, model, caches[first], probe, long_prefix))
    per_key = max(long - short, 0.0) / (first * probe * (long_prefix - prefix)) if use_long else 0.0
    return seconds, per_key


def draft_budgets(drafter) -> list:
    """The budgets the drafter calibration times: 1, 2, 4, ... below max_nodes, and max_nodes;
    max_nodes alone for a drafter that `drafts_for_free` (generate asks it for its full draft)."""
    most = int(drafter.max_nodes)
    if drafter.drafts_for_free:
        return [most]
    budgets = [1]
    while budgets[-1] * 2 < most:
        budgets.append(budgets[-1] * 2)
    return budgets + ([most] if most > budgets[-1] else [])


@torch.inference_mode()
def calibrate_drafter(target, drafter, *, rows: Sequence[int] = ROWS, prefix: int = CAL_PREFIX, repeats: int = 3,
                      verbose: bool = True) -> DraftCost:
    """Time `drafter` drafting beside `target`: for each row count in `rows`, one `propose` per
    budget of `draft_budgets(drafter)` (the budget None for a drafter that `drafts_for_free`,
    as generate calls it), in `repeats` interleaved rounds keeping each point's best.

    Each row count runs its own twin of the drafter (`cost_twin`: the drafter's
    own state, a suffix cache or an online head, is left as it was) on made-up rows: random
    tokens of the target's vocabulary, `prefix` long, advanced by one token before every
    proposal (its catch-up work), with zero hidden states for drafters that read the
    target's (`observe`: what generate would have handed them). Random rows give n-gram
    and suffix lookups few matches: their measured cost is the lookup's, which is most of it.
    """
    from .. import config
    from . import hf

    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    rows = sorted(int(r) for r in rows)
    param = next(target.parameters())
    device = param.device
    cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    budgets = draft_budgets(drafter)
    steps = repeats * len(budgets)
    capacity = prefix + steps + int(drafter.max_nodes) + 2
    start = time.perf_counter()
    if verbose:
        print(f"specdec: measuring the drafter on this device (once per drafter, target and device) ...",
              end="", file=sys.stderr, flush=True)
    generator = torch.Generator().manual_seed(0)
    twins, histories, lengths = {}, {}, {}
    for r in rows:
        twins[r] = cost_twin(drafter)
        histories[r] = torch.randint(0, int(cfg.vocab_size), (r, capacity), generator=generator).to(device)
        lengths[r] = torch.full((r,), prefix, dtype=torch.int64, device=device)
    seconds = {r: [math.inf] * len(budgets) for r in rows}
    with hf.use_tree_attention(target, *drafter.models), config.value_checks(False):
        try:
            for r in rows:
                twins[r].start(histories[r], lengths[r], capacity)
                _feed(twins[r], cfg, param, r, prefix - 1, accepted=False)
            for _ in range(repeats):
                for r in rows:
                    for i, n in enumerate(budgets):
                        lengths[r] = lengths[r] + 1  # the last step emitted one token
                        _feed(twins[r], cfg, param, r, 1, accepted=True)
                        budget = None if drafter.drafts_for_free else torch.full((r,), n, dtype=torch.int64, device=device)
                        begin = device_clock(device)
                        twins[r].propose(histories[r], lengths[r], None, budget)
                        seconds[r][i] = min(seconds[r][i], device_clock(device) - begin)
        finally:
            for twin in twins.values():
                twin.finish()
    if verbose:
        print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr)
    # Never cheaper for more nodes: a point above a later one is noise (as in `calibrate`).
    tables = {r: (budgets, torch.tensor(s).flip(0).cummin(0).values.flip(0).tolist()) for r, s in seconds.items()}
    return DraftCost(draft_identity(target, drafter), tables)


def _feed(drafter, cfg, param, rows: int, positions: int, accepted: bool) -> None:
    """Zero hidden states for `positions` positions of every row, to a drafter that reads the
    target's: the prefill's (accepted False) or a step's whose root alone was accepted."""
    if not drafter.needs_hidden_states:
        return
    layers = (len(drafter.hidden_layers),) if drafter.hidden_layers else ()
    hidden = torch.zeros(rows, positions, *layers, int(cfg.hidden_size), dtype=param.dtype, device=param.device)
    if not accepted:
        drafter.observe(hidden)
        return
    nodes = torch.zeros(rows, positions, dtype=torch.int64, device=param.device)
    drafter.observe(hidden, nodes, torch.zeros(rows, dtype=torch.int64, device=param.device))
