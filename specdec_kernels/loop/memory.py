"""A CPU model's weights in transparent huge pages (2 MB instead of 4 KB).

A decoding step on a CPU streams every weight from memory once (540 MB a step for the default
model in fp32), and with 4 KB pages that is ~130,000 pages a step, each a TLB miss and a page
walk, and each a boundary where the hardware prefetchers stop. Linux backs memory with 2 MB
pages where a region asks for them (`madvise(MADV_HUGEPAGE)`) when its transparent-huge-page
mode is `madvise` (the usual default) or `always`; torch's CPU allocator asks only under
`THP_MEM_ALLOC_ENABLE=1`, read once at its first allocation (too late to set from Python).

`weights_in_huge_pages(*modules)` copies the large parameters of each module into one such
region (values, dtypes, shapes and tied parameters unchanged; the old storage is freed when
nothing else holds it). `generate` calls it for CPU targets and draft models
(`config.huge_pages`). Measured on the AMD EPYC (2 AVX2 cores, 4 KB pages vs 2 MB, same
process, interleaved): one 440 MB product read 19.5 -> 20.8 GB/s (medians of 30), the default
model's 210 products 18.9 -> 19.4 GB/s, batch-1 `generate` calls (`tools/ab_config.py --flag huge_pages`,
medians of 24 pairs) 1.073x faster plain and 1.016x with `default_drafter`: see docs/loop.md.
"""

import mmap
from pathlib import Path
from typing import Optional

import torch

HUGE_PAGE = 2 << 20
# Parameters smaller than this stay where they are (norm weights, biases: a few KB each;
# their pages are shared with others and cost nothing to keep).
MIN_BYTES = 64 << 10
_ALIGN = 64  # each parameter starts on a cache line (and any dtype's element boundary)
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_REGIONS = "_specdec_huge_page_regions"  # on a module: [(start, end)] of its regions, addresses
_SEEN = "_specdec_huge_page_seen"  # on a module: its parameters' addresses after the last call


def transparent_huge_pages() -> Optional[str]:
    """This machine's transparent-huge-page mode ("always", "madvise" or "never"), or None
    where the kernel does not say (not Linux, or THP not built in)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1: end] if 0 <= start < end else None


def huge_page_buffer(nbytes: int) -> Optional[torch.Tensor]:
    """uint8 [nbytes], untouched, in private anonymous memory advised MADV_HUGEPAGE and starting
    on a 2 MB boundary (its first write faults 2 MB pages in where the kernel has them), or
    None where the transparent-huge-page mode is "never" or unknown. The tensor keeps the
    memory mapped for as long as it (or a view of it) lives."""
    if transparent_huge_pages() not in ("always", "madvise"):
        return None
    # Private (Python's default, shared, would be shmem, under other THP rules), and one huge
    # page longer so that the start can be rounded up to a 2 MB boundary.
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults then take 2 MB pages
    except OSError:  # no address space, or a kernel that refuses the advice: 4 KB pages it is
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # (keeps the mmap alive)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start: start + nbytes]


def _in_regions(tensor: torch.Tensor, regions) -> bool:
    address = tensor.data_ptr()
    return any(start <= address < end for start, end in regions)


def _movable(p: torch.Tensor) -> bool:
    """A plain, dense CPU parameter worth moving whose storage is its own, contiguous, from its
    start (views into another tensor's storage stay: moving one would separate it from the
    rest; tensor subclasses, such as quantized weights, and sparse or quantized layouts stay)."""
    return (type(p.data) is torch.Tensor and p.layout == torch.strided and not p.is_quantized
            and p.device.type == "cpu" and p.is_contiguous() and p.storage_offset() == 0
            and p.numel() * p.element_size() >= MIN_BYTES
            and p.untyped_storage().nbytes() == p.numel() * p.element_size())


def weights_in_huge_pages(*modules: torch.nn.Module) -> int:
    """Move the large CPU parameters of each module (at least MIN_BYTES each, contiguous, owning
    their storage) into one region of anonymous memory advised MADV_HUGEPAGE, so the kernel
    backs it with 2 MB pages. Values, shapes, dtypes and `requires_grad` stay as they were;
    tied parameters (one Parameter in two modules) stay tied. Parameters already moved are
    left alone, so a second call moves nothing (and one after `module.to(...)` moves the new
    tensors). Does nothing where the transparent-huge-page mode is "never" or unknown.

    Returns the bytes moved. Whether the kernel found free 2 MB pages is its business: under
    memory fragmentation part of the region may stay in 4 KB pages (AnonHugePages in
    /proc/meminfo shows what it got)."""
    if transparent_huge_pages() not in ("always", "madvise"):
        return 0
    moved = 0
    for module in modules:
        # The same parameters at the same addresses as after the last call: nothing to do (the
        # default model's 272 parameters: ~1.4 ms for this walk, ~3 ms for the checks below).
        seen = tuple(p.data_ptr() for p in module.parameters())
        if getattr(module, _SEEN, None) == seen:
            continue
        regions = getattr(module, _REGIONS, [])
        params = [p for p in module.parameters() if _movable(p) and not _in_regions(p, regions)]
        if not params:
            setattr(module, _SEEN, seen)
            continue
        # One home per storage: two Parameters over one storage (weights tied by hand) stay one.
        offsets, size = {}, 0
        for p in params:
            if p.untyped_storage().data_ptr() not in offsets:
                offsets[p.untyped_storage().data_ptr()] = size
                size += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        if size < HUGE_PAGE:  # not one whole huge page to fill: nothing to gain
            setattr(module, _SEEN, seen)
            continue
        region = huge_page_buffer(size)
        if region is None:
            return moved
        homes = {}
        with torch.no_grad():
            for p in params:
                key = p.untyped_storage().data_ptr()
                offset, nbytes = offsets[key], p.numel() * p.element_size()
                if key not in homes:
                    homes[key] = region[offset: offset + nbytes]
                    homes[key].view(p.dtype).view(p.shape).copy_(p.data)
                p.data = homes[key].view(p.dtype).view(p.shape)
        start = region.data_ptr()
        setattr(module, _REGIONS, regions + [(start, start + size)])
        setattr(module, _SEEN, tuple(p.data_ptr() for p in module.parameters()))
        moved += size
    return moved
