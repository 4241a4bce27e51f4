"""The floor of plain decoding: how fast one target step could possibly be on this machine.

A decode step at batch B reads every weight once and does 2 flops per weight and token, so it
takes at least max(weight bytes / memory bandwidth, B * flops per token / peak flops). Both
rates are measured here, in the run: bandwidth by summing (reading) a large array with torch
on the run's threads, peak by a large matmul in the weights' dtype. The floor leaves out the KV
cache reads and the attention flops (small next to the weights for a short context), so it is a
lower bound on the step time: every measured figure is at most 1.0 of it for plain decoding;
speculative decoding emits several tokens per step and can pass it (that is its point).

On this CPU (300 MiB shared L3) a bf16 copy of the default model (270 MB) nearly fits in the
last-level cache, so bandwidth is measured twice: on an array of the weights' own size (read
again and again, as decoding reads the weights) and on an array several times the last-level
cache (DRAM); the floor takes the faster of the two. torch's reductions are not the fastest
possible reads, so an engine with better streaming kernels can come out slightly above 1.0.
Our greedy steps read the LM head as its int8 copy (`small_linear_argmax`: a quarter of its
fp32 bytes, half of its bf16 ones; the default model's head: 113 MB fp32, 57 MB bf16, 28 MB int8), and
the floor counts the head in the weights' dtype, so they too may come out above 1.0 by that much.
"""

import time

import torch


def decode_floor(*, weight_bytes: float, flops_per_token: float, bandwidth: float, peak_flops: float,
                 batch_size: int = 1) -> dict:
    """The plain-decoding floor of one step at `batch_size` tokens.

    weight_bytes: bytes of weights read per step (each weight once, whatever the batch);
    flops_per_token: 2 * multiply-accumulate weights per token; bandwidth: bytes/s; peak_flops:
    flops/s. Returns {"memory_s", "compute_s", "step_s" (the larger), "bound" ("memory" or
    "compute"), "tokens_per_s" (batch_size / step_s)}. Raises ValueError on a non-positive rate.
    """
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak_flops must be > 0, got {bandwidth} and {peak_flops}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    memory_s = weight_bytes / bandwidth
    compute_s = batch_size * flops_per_token / peak_flops
    step_s = max(memory_s, compute_s)
    return dict(memory_s=memory_s, compute_s=compute_s, step_s=step_s,
                bound="memory" if memory_s >= compute_s else "compute", tokens_per_s=batch_size / step_s)


def model_step_cost(model) -> dict:
    """{"weight_bytes", "flops_per_token", "parameters"} of one decode step of a transformers
    causal LM: every parameter counted once (a tied embedding is the LM head: read and multiplied
    once per step); an untied input embedding is a row lookup, so neither its bytes nor flops
    count. Flops: 2 per weight of every matrix (norm vectors and biases left out)."""
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head.weight if head is not None else None
    tied = embedding is not None and head is not None and embedding.data_ptr() == head.data_ptr()
    seen, weight_bytes, flops, parameters = set(), 0, 0, 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if embedding is not None and p.data_ptr() == embedding.data_ptr() and not tied:
            continue
        weight_bytes += p.numel() * p.element_size()
        parameters += p.numel()
        if p.dim() >= 2:
            flops += 2 * p.numel()
    return dict(weight_bytes=weight_bytes, flops_per_token=flops, parameters=parameters)


def _best_seconds(call, reps):
    call()  # first touch / warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int, *, device="cpu", reps: int = 5) -> float:
    """Bytes/s reading an fp32 array of about `nbytes` once (no writes), best of `reps` runs of
    two reductions (`sum`, and `dot` of the array with itself, which vectorises differently in
    torch's CPU kernels; each reads every byte once): the faster one is the better estimate of
    what the memory system delivers. On a CPU the array is read in 4 KB pages (torch's) and,
    where the kernel offers them, in 2 MB pages (`loop.memory`, where `generate` keeps the
    weights), and the faster counts."""
    from ...loop.memory import huge_page_buffer

    count = max(int(nbytes) // 4, 1 << 16)
    arrays = [torch.ones(count, dtype=torch.float32, device=device)]
    huge = huge_page_buffer(count * 4) if torch.device(device).type == "cpu" else None
    if huge is not None:
        arrays.append(huge.view(torch.float32).fill_(1.0))

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    seconds = min(min(_best_seconds(lambda: (x.sum(), sync()), reps), _best_seconds(lambda: (torch.dot(x, x), sync()), reps))
                  for x in arrays)
    result = count * 4 / seconds
    del arrays, huge
    return result


def measure_peak_flops(dtype=torch.float32, *, n: int = 2048, device="cpu", reps: int = 3) -> float:
    """Flops/s of an n x n by n x n matmul in `dtype`, best of reps."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def mm():
        a @ b
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)

    return 2 * n ** 3 / _best_seconds(mm, reps)


def measure_floor(model, batch_sizes=(1,), *, dram_bytes=None, matmul_n: int = 2048) -> dict:
    """The floor of `model`'s plain decoding on its device with the current torch thread count:
    the step's cost (`model_step_cost`), the measured rates, and per batch size the
    `decode_floor` (keys: str(batch size)). dram_bytes: the array for the DRAM figure (default
    4x the last-level cache, 1-2 GiB); matmul_n: the peak's matmul size."""
    from .. import common

    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cost = model_step_cost(model)
    llc = common.last_level_cache_bytes(device) if device.type == "cpu" else 0
    start = time.perf_counter()
    bandwidth = measure_bandwidth(cost["weight_bytes"], device=device)
    dram = measure_bandwidth(dram_bytes or min(max(4 * llc, 1 << 30), 2 << 30), device=device, reps=3)
    peak = measure_peak_flops(dtype, n=matmul_n, device=device)
    peak_fp32 = peak if dtype == torch.float32 else measure_peak_flops(torch.float32, n=matmul_n, device=device)
    # the floor takes the faster of the two reads: a floor must not be slower than what was measured
    floors = {str(b): decode_floor(weight_bytes=cost["weight_bytes"], flops_per_token=cost["flops_per_token"],
                                   bandwidth=max(bandwidth, dram), peak_flops=peak, batch_size=b) for b in batch_sizes}
    return dict(cost, dtype=str(dtype).replace("torch.", ""), threads=torch.get_num_threads(),
                bandwidth=max(bandwidth, dram), bandwidth_weight_sized=bandwidth, bandwidth_dram=dram, last_level_cache_bytes=llc,
                peak_flops=peak, peak_flops_fp32=peak_fp32, by_batch=floors,
                measure_s=time.perf_counter() - start,
                how=("bandwidth: torch sum / dot of an fp32 array the size of the weights (best of 5; on a CPU in 4 KB and "
                     "in 2 MB pages, the faster), and of one "
                     ">= 4x the last-level cache (DRAM); peak: a 2048^3 matmul in the weights' dtype (best of 3); "
                     "floor step = max(weight bytes / bandwidth, batch * flops per token / peak); KV cache and "
                     "attention left out (a lower bound)"))


def best_floor(first: dict, second: dict) -> dict:
    """Two `measure_floor` results of the same model (the run measures at its start and its end)
    as one: each rate the faster of the two (a floor must not be slower than anything measured:
    a measurement disturbed by other work on a shared machine only reads slower), the floors
    recomputed from them; both measurements kept under "measurements"."""
    bandwidth = max(first["bandwidth"], second["bandwidth"])
    peak = max(first["peak_flops"], second["peak_flops"])
    floors = {b: decode_floor(weight_bytes=first["weight_bytes"], flops_per_token=first["flops_per_token"],
                              bandwidth=bandwidth, peak_flops=peak, batch_size=int(b)) for b in first["by_batch"]}
    keep = ("bandwidth", "bandwidth_weight_sized", "bandwidth_dram", "peak_flops", "peak_flops_fp32")
    return dict(first, bandwidth=bandwidth, peak_flops=peak,
                bandwidth_weight_sized=max(first["bandwidth_weight_sized"], second["bandwidth_weight_sized"]),
                bandwidth_dram=max(first["bandwidth_dram"], second["bandwidth_dram"]),
                peak_flops_fp32=max(first["peak_flops_fp32"], second["peak_flops_fp32"]), by_batch=floors,
                measurements=[{k: f[k] for k in keep} for f in (first, second)])


def add_floor_shares(rows, floor) -> None:
    """floor_share on every timed row: its tokens/s over the floor's tokens/s at its batch size
    (plain decoding: at most ~1; speculation can pass 1)."""
    if not floor:
        return
    for r in rows:
        f = floor["by_batch"].get(str(r["config"]["batch"]))
        if f and r.get("tokens_per_s"):
            r["floor_share"] = r["tokens_per_s"] / f["tokens_per_s"]
