"""Drive every CUDA op once on small inputs that reach their edge paths, for compute-sanitizer;
and judge a sanitizer log (which reports are errors, which one is expected).

Run the ops (each result is compared with backend="reference", so a sanitizer-clean but wrong
kernel still fails):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tools/sanitize_ops.py
    python tools/sanitize_ops.py --device cpu      # same cases on the compiled CPU kernels (CI runs this)

Judge a log (what tools/gpu_session.sh's `sanitize` stage does after each tool):

    python tools/sanitize_ops.py --check-log racecheck LOG --app-rc RC

PYTORCH_NO_CUDA_MEMORY_CACHING=1 matters: under torch's caching allocator a tensor is a slice
of a larger pooled segment, so memcheck cannot see an access past its end, and initcheck sees
memory an earlier tensor initialised. With it, every tensor is its own cudaMalloc.

What the cases reach (device "cuda": backends "cuda" and, where it has a kernel, "triton"):
* tree_mask / pack_tree_mask: T = 1, 17, 63, 64, 65, 128, 130 (one, two and three 64-bit
  words), ragged rows (trailing padding nodes), [T] and [B, T] parents, int32 parents, random
  bool masks (not only tree masks) and strided mask views.
* tree_attention: the mma.sync kernel (bf16/fp16, D = 64/128/256, 16-byte aligned rows, HF
  [B, H, S, D] views, GQA up to 7 query heads per KV head, split-KV with prefixes up to 4096,
  T = 1 decode, T = 65 and 128 multi-word masks) and the SIMT fallback (fp32, D = 80, rows
  8 bytes off alignment); prefixes 0, 1 and at the cache's end; bool and packed masks.
* verify: greedy and sampled rows (temperature, top-k, top-p) in one batch, deterministic
  drafts and draft_probs, chains and ragged random trees up to T = 128, odd vocabularies up
  to 128256, NaN / inf logits; greedy rows must equal the reference exactly, sampled rows must
  form valid paths and (nearly all) equal the reference (both read the same Philox uniforms).
* compact_kv_cache_: T = 1, 8, 65, 128, accepted paths from random trees, ragged prefixes
  incl. 0 and S - T, fp32/bf16/fp16 caches (contiguous, HF views, odd slices: every vector
  width), 300 caches in one call (two launches). Every accepted node id is < T (the width of
  accepted_nodes) and cache_seqlens + T <= S, so the cases are valid under both the strict
  value check (node ids below T) and the relaxed one (bounded by the cache).
* ngram_propose / ngram_propose_tree: int32/int64 and strided histories, lengths 0, 1, 2 and
  full, small and large vocabularies, both policies, tree widths 1-8 and node budgets, and a
  20000-token history with ~10000 distinct continuations (the tree kernel's overflow rounds).
* paged caches (tree_attention / compact_kv_cache_ with block_table: the ops
  tree_attention_paged, compact_kv_cache_paged_): pages of 1, 3, 5, 16 and 32 slots (power of
  two or not) in a shuffled pool with spare pages, block tables with junk ids past each row's
  pages, mma and SIMT tree attention (split-KV, T = 65 and 128) against the dense reference,
  compaction of several pools against the paged reference, whole pools compared.

Exit status of a run: 0 all matched; 1 a result differs from the reference; 2 the device or a
compiled kernel is missing (sanitizing the reference would prove nothing).

----------------------------------------------------------------------------------------------
racecheck and the n-gram tree kernel: decision
----------------------------------------------------------------------------------------------
ngram_propose_tree_kernel (csrc/include/specdec/ngram.cuh, phase 2) groups continuations in a
lock-free shared-memory hash table: a thread reads a slot with a plain (volatile) 64-bit load
and claims an empty one with atomicCAS, while other threads of the block may claim the same
slot. That read/atomic-write pair is a data race by racecheck's definition and by design: an
aligned 64-bit shared-memory load is single-copy atomic, so the reader sees 0 (then its own
atomicCAS decides) or the complete word of the thread that claimed it; every later use is an
atomic or comes after a __syncthreads. We keep racecheck on for every kernel and accept
exactly that pair: a racecheck report is expected iff every source location in it is one of
the two ngram.cuh lines holding the slot load and the slot atomicCAS (found by their text in
the current ngram.cuh, so the filter follows edits of the file; if either text is gone,
nothing is expected and such a report fails the stage). Locations need line info: setup.py
compiles with -lineinfo. Any other report, in this kernel or another, is an error, whatever
its severity (racecheck's "Warning" included). (Reading the slot with atomicCAS alone would
silence racecheck at the cost of an atomic per probe; the kernel's owner may choose that.)

How --check-log decides (exit 0 = pass, 1 = fail), for every tool:
* the application's exit status (--app-rc; compute-sanitizer passes it through unless given
  --error-exitcode) must be 0 and the log must hold this script's "sanitize_ops: ok" line, so
  a crash, a traceback or a mismatch fails the stage;
* memcheck, synccheck, initcheck: the "ERROR SUMMARY: N errors" line must be present with N = 0;
* racecheck: every report is parsed (one per "Race reported between" / "Potential ... hazard"
  line with its continuation lines); each must be the expected pair above; the number of
  reports must equal the hazard count of "RACECHECK SUMMARY: N hazards displayed" when that
  line is present, and the "ERROR SUMMARY" count may not exceed it (so a report format the
  parser misses fails the stage rather than passing it).
"""

import argparse
import faulthandler
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGRAM_CUH = os.path.join(ROOT, "csrc", "include", "specdec", "ngram.cuh")
OK_LINE = "sanitize_ops: ok"
# Source text of the two accesses of the intended lock-free race (see the docstring).
EXPECTED_RACE_TEXT = (
    "static_cast<volatile uint64_t*>(&slots[idx])",
    "atomicCAS(reinterpret_cast<unsigned long long*>(&slots[idx])",
)
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


# ============================================================================ log judging


def expected_race_locations(source_path: str = NGRAM_CUH) -> set:
    """{("ngram.cuh", line)} for the lines of the intended slot load / atomicCAS (empty if gone)."""
    try:
        with open(source_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    found = set()
    for text in EXPECTED_RACE_TEXT:
        hits = [i + 1 for i, line in enumerate(lines) if text in line]
        if len(hits) != 1:  # gone or ambiguous: expect nothing rather than guess
            return set()
        found.add((os.path.basename(source_path), hits[0]))
    return found


_REPORT_START = re.compile(r"Race reported between|Potential \w+ hazard detected")
_LOCATION = re.compile(r"([\w./+-]+\.(?:cuh|cu|hpp|h|cpp|cc|py)):(\d+)")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed")


def _strip(line: str) -> str:
    return re.sub(r"^=+\s?", "", line).strip()


def race_reports(log: str) -> list:
    """Racecheck reports: lists of lines, each starting at a report line and holding its
    continuation lines (the "and ... access at" / thread lines) up to the next report or an
    empty "=========" line."""
    reports, current = [], None
    for raw in log.splitlines():
        line = _strip(raw)
        if _REPORT_START.search(line):
            current = [line]
            reports.append(current)
        elif current is not None and line and not line.startswith(("RACECHECK SUMMARY", "ERROR SUMMARY")):
            current.append(line)
        else:
            current = None
    return reports


def report_is_expected(report: list, expected: set) -> bool:
    """The report names both of its accesses by file:line, and each is an expected location."""
    locations = [(os.path.basename(path), int(line)) for path, line in _LOCATION.findall(" ".join(report))]
    return bool(expected) and len(locations) >= 2 and set(locations) <= expected


def check_log(tool: str, log: str, app_rc: int, expected: set = None) -> tuple:
    """(passed, list of reasons) for one sanitizer log; see the module docstring."""
    if tool not in TOOLS:
        raise ValueError(f"tool: expected one of {TOOLS}, got {tool!r}")
    expected = expected_race_locations() if expected is None else expected
    reasons = []
    if app_rc != 0:
        reasons.append(f"the application exited with status {app_rc}")
    if OK_LINE not in log:
        reasons.append(f"no '{OK_LINE}' line: the op run did not finish or a result differed")
    summary = _ERROR_SUMMARY.findall(log)
    if tool == "racecheck":
        reports = race_reports(log)
        unexpected = [r for r in reports if not report_is_expected(r, expected)]
        for r in unexpected:
            reasons.append("unexpected racecheck report: " + " | ".join(r)[:600])
        displayed = _RACE_SUMMARY.findall(log)
        if displayed and int(displayed[-1]) != len(reports):
            reasons.append(f"RACECHECK SUMMARY counts {displayed[-1]} hazards but {len(reports)} reports were parsed")
        if summary and int(summary[-1]) > len(reports):  # each error is one displayed report
            reasons.append(f"ERROR SUMMARY counts {summary[-1]} errors but {len(reports)} reports were parsed")
        if not displayed and not summary:
            reasons.append("no RACECHECK SUMMARY or ERROR SUMMARY line: the sanitizer did not finish")
    else:
        if not summary:
            reasons.append("no ERROR SUMMARY line: the sanitizer did not finish")
        elif int(summary[-1]) != 0:
            # Each error line with the next one, which names the kernel ("at kernel+0x.. in file:line").
            lines = log.splitlines()
            errors = [_strip(x) + " " + (_strip(lines[i + 1]) if i + 1 < len(lines) else "")
                      for i, x in enumerate(lines)
                      if re.match(r"=+\s+(Invalid|Uninitialized|Barrier|Program hit|Race|Error|Warning|Misaligned|"
                                  r"Out-of-range)", x)]
            reasons.append(f"{summary[-1]} errors; first: " + " | ".join(errors[:5])[:900])
    return not reasons, reasons


# ============================================================================ the op cases


class Runner:
    """Runs each case on every backend under test and compares with the reference."""

    def __init__(self, device: str, gen, quick: bool = False):
        import torch

        import specdec_kernels as sk

        self.torch, self.sk, self.device, self.gen, self.quick = torch, sk, device, gen, quick
        self.failures = 0
        self.cases = 0
        self.sampled_rows = 0
        self.sampled_same = 0

    # ---------------------------------------------------------------- helpers

    def backends(self, op: str) -> list:
        found = self.sk.available_backends(op, self.device)
        wanted = ("cuda", "triton") if self.device == "cuda" else ("cpu",)
        return [b for b in wanted if b in found]

    def randint(self, low, high, size=()):
        return self.torch.randint(low, high, size, generator=self.gen)

    def randn(self, *shape, dtype=None):
        return self.torch.randn(*shape, generator=self.gen).to(dtype or self.torch.float32).to(self.device)

    def parents(self, batch: int, num_nodes: int, kind: str = "random", ragged: bool = True):
        """int64 [B, T] on the device; ragged rows end in padding nodes (parent -1)."""
        torch = self.torch
        out = torch.full((batch, num_nodes), -1, dtype=torch.int64)
        for b in range(batch):
            real = int(self.randint(1, num_nodes + 1)) if ragged and b > 0 else num_nodes
            for i in range(1, real):
                out[b, i] = i - 1 if kind == "chain" else int(self.randint(0, i))
        return out.to(self.device)

    def reference(self, op, *args, **kwargs):
        """op(*args, **kwargs, backend="reference") on CPU copies of the tensors, the result moved
        to the device. Under a sanitizer every kernel launch is instrumented, and the reference's
        loops launch thousands of small torch kernels (the first window's sanitized `verify`
        part ran out of its 300 s); the ops' results do not depend on the device (integer
        Philox uniforms, fp32 math), and the comparisons keep their tolerances."""
        torch = self.torch

        def to(x, device):
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, (tuple, list)):
                items = [to(item, device) for item in x]
                return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            return x

        cpu_args = [to(a, "cpu") for a in args]
        cpu_kwargs = {k: to(v, "cpu") for k, v in kwargs.items()}
        return to(op(*cpu_args, backend="reference", **cpu_kwargs), self.device)

    def fail(self, what: str) -> None:
        print(f"  MISMATCH {what}", flush=True)
        self.failures += 1

    def check(self, ok: bool, what: str) -> None:
        self.cases += 1
        if not ok:
            self.fail(what)

    # ---------------------------------------------------------------- tree_mask, pack_tree_mask

    def tree_masks(self) -> None:
        torch, sk = self.torch, self.sk
        for backend in self.backends("tree_mask"):
            for num_nodes in (1, 17, 63, 64, 65, 128, 130):
                for kind in ("random", "chain"):
                    parents = self.parents(3, num_nodes, kind)
                    for p in (parents, parents.to(torch.int32), parents[0]):
                        got = sk.tree_mask(p, backend=backend)
                        ref = self.reference(sk.tree_mask, p)
                        self.check(torch.equal(got, ref), f"tree_mask[{backend}] T={num_nodes} {kind} {tuple(p.shape)}")
        for backend in self.backends("pack_tree_mask"):
            for num_nodes in (1, 17, 63, 64, 65, 128, 130):
                tree = self.reference(sk.tree_mask, self.parents(3, num_nodes))
                noise = (torch.rand(3, num_nodes, 2 * num_nodes, generator=self.gen) < 0.5).to(self.device)
                for mask in (tree, tree[1], noise[:, :, ::2], noise[:, :, :num_nodes], torch.ones_like(tree)):
                    got = sk.pack_tree_mask(mask, backend=backend)
                    ref = self.reference(sk.pack_tree_mask, mask)
                    self.check(torch.equal(got, ref), f"pack_tree_mask[{backend}] T={num_nodes} {tuple(mask.shape)}")

    # ---------------------------------------------------------------- tree_attention

    TREE_ATTENTION_CASES = [  # (T, prefixes, Hq, Hkv, D, dtype name, layout)
        (17, (300, 0, 37), 8, 2, 128, "bfloat16", "hf"),  # mma, HF views
        (65, (2000, 1, 129), 8, 1, 64, "float16", "bshd"),  # mma, split-KV, two mask words
        (128, (129, 0, 64), 4, 2, 256, "bfloat16", "bshd"),  # mma, D = 256, T = 128
        (1, (4096, 3, 0), 32, 8, 128, "bfloat16", "hf"),  # decode: many KV splits
        (33, (1000, 500, 2), 28, 4, 128, "float16", "bshd"),  # GQA 7: row tiles cut a node's heads
        (9, (65, 0, 7), 4, 2, 64, "float32", "bshd"),  # SIMT fallback: fp32
        (33, (400, 17, 0), 6, 3, 80, "float16", "bshd"),  # SIMT fallback: D = 80
        (7, (300, 0, 5), 4, 2, 128, "bfloat16", "unaligned"),  # SIMT fallback: rows 8 bytes off
    ]
    TOL = {"float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}

    def tree_attention_case(self, num_nodes, prefixes, hq, hkv, dim, dtype_name, layout):
        torch = self.torch
        dtype = getattr(torch, dtype_name)
        batch = len(prefixes)
        seqlens = torch.tensor(prefixes, dtype=torch.int32, device=self.device)
        cache_len = max(prefixes) + num_nodes  # the longest row ends exactly at the cache's end
        extra = 4 if layout == "unaligned" else 0
        if layout == "hf":
            q = self.randn(batch, hq, num_nodes, dim, dtype=dtype).transpose(1, 2)
            k = self.randn(batch, hkv, cache_len, dim, dtype=dtype).transpose(1, 2)
            v = self.randn(batch, hkv, cache_len, dim, dtype=dtype).transpose(1, 2)
        else:
            q = self.randn(batch, num_nodes, hq, dim + extra, dtype=dtype)[..., extra:]
            k = self.randn(batch, cache_len, hkv, dim + extra, dtype=dtype)[..., extra:]
            v = self.randn(batch, cache_len, hkv, dim + extra, dtype=dtype)[..., extra:]
        mask = self.reference(self.sk.tree_mask, self.parents(batch, num_nodes))
        return q, k, v, mask, seqlens

    def tree_attention(self) -> None:
        torch, sk = self.torch, self.sk
        for backend in self.backends("tree_attention"):
            for case in self.TREE_ATTENTION_CASES:
                if self.quick and max(case[1]) >= 1000:
                    continue
                q, k, v, mask, seqlens = self.tree_attention_case(*case)
                for m in (mask, self.reference(sk.pack_tree_mask, mask)):
                    if backend == "triton" and case[-1] == "unaligned":
                        continue  # the Triton kernel takes any alignment, but this case is for the CUDA fallback
                    out = sk.tree_attention(q, k, v, m, seqlens, backend=backend)
                    ref = self.reference(sk.tree_attention, q, k, v, m, seqlens)
                    atol, rtol = self.TOL[case[5]]
                    same = out.shape == ref.shape and bool(torch.isfinite(out).all()) and \
                        torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
                    self.check(same, f"tree_attention[{backend}] T={case[0]} D={case[4]} {case[5]} {case[6]} "
                                     f"{'packed' if m.dtype == torch.int64 else 'bool'}")

    # ---------------------------------------------------------------- verify

    VERIFY_CASES = [  # (B, T, V, draft probs, dtype name, tree kind, nonfinite)
        (4, 1, 1000, False, "float32", "random", False),
        (4, 6, 32003, True, "bfloat16", "chain", False),
        (4, 17, 5003, False, "float16", "random", False),
        (4, 65, 4099, True, "float32", "random", True),
        (4, 128, 2053, False, "bfloat16", "random", False),
        (8, 5, 128256, False, "bfloat16", "chain", False),  # vocab split across many blocks
        (8, 9, 50000, True, "float16", "random", True),
    ]

    def verify_case(self, batch, num_nodes, vocab, with_probs, dtype_name, kind, nonfinite):
        torch = self.torch
        parents = self.parents(batch, num_nodes, kind)
        real = parents >= 0
        real[:, 0] = True
        logits = torch.randn(batch, num_nodes, vocab, generator=self.gen) * 3
        if with_probs:
            tokens = self.randint(0, vocab, (batch, num_nodes))
            probs = torch.softmax(torch.randn(batch, num_nodes, vocab, generator=self.gen) * 2, -1)
        else:  # distinct tokens in a row, so siblings are distinct
            tokens = torch.stack([torch.randperm(vocab, generator=self.gen)[:num_nodes] for _ in range(batch)])
            probs = None
        parents_cpu = parents.cpu()
        for b in range(batch):  # make the target like most drafts, so paths go deep
            for i in range(1, num_nodes):
                p = int(parents_cpu[b, i])
                if p >= 0 and float(torch.rand((), generator=self.gen)) < 0.7:
                    logits[b, p, tokens[b, i]] += 12.0
                    if probs is not None:
                        probs[b, p, tokens[b, i]] += 0.5
        if probs is not None:
            probs = (probs / probs.sum(-1, keepdim=True)).to(getattr(torch, dtype_name)).to(self.device)
        if nonfinite:
            r = torch.rand(batch, num_nodes, vocab, generator=self.gen)
            logits = torch.where(r < 0.02, float("nan"), logits)
            logits = torch.where((r >= 0.02) & (r < 0.04), float("-inf"), logits)
            logits[-1, -1] = float("-inf")  # a node whose every logit is -inf
        tokens = torch.where(real.cpu(), tokens, torch.full_like(tokens, -1))
        greedy = torch.arange(batch) % 4 == 0  # rows 0, 4: greedy; the others sample
        temperature = torch.where(greedy, 0.0, torch.rand(batch, generator=self.gen) + 0.3)
        top_k = torch.tensor([0, 50, 0, 7, 1, 0, vocab, 3])[:batch]
        top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 0.3, 0.99, 1.0])[:batch]
        dev = self.device
        return dict(target_logits=logits.to(getattr(torch, dtype_name)).to(dev), tree_tokens=tokens.to(dev),
                    parents=parents, draft_probs=probs, temperature=temperature.to(dev), top_k=top_k.to(dev),
                    top_p=top_p.to(dev), seed=1234), greedy

    def valid_path(self, out, tokens, parents, vocab) -> bool:
        acc, num, emitted = out.accepted_nodes.cpu(), out.num_accepted.cpu(), out.output_tokens.cpu()
        tokens, parents = tokens.cpu(), parents.cpu()
        for b in range(acc.shape[0]):
            n = int(num[b])
            if not (0 <= n < acc.shape[1] and int(acc[b, 0]) == 0 and 0 <= int(emitted[b, n]) < vocab):
                return False
            for d in range(1, n + 1):
                node = int(acc[b, d])
                if int(parents[b, node]) != int(acc[b, d - 1]) or int(emitted[b, d - 1]) != int(tokens[b, node]):
                    return False
        return True

    def verify(self) -> None:
        torch, sk = self.torch, self.sk
        for backend in self.backends("verify"):
            for case in self.VERIFY_CASES:
                if self.quick and case[2] > 10000:
                    continue
                kwargs, greedy = self.verify_case(*case)
                what = f"verify[{backend}] B={case[0]} T={case[1]} V={case[2]} probs={case[3]} {case[4]}"
                # A line before each launch: where a sanitized run that never ends stopped.
                print(f"  {what} ...", flush=True)
                t0 = time.perf_counter()
                out = sk.verify(backend=backend, **kwargs)
                if self.device == "cuda":
                    torch.cuda.synchronize()
                print(f"  {what}: {time.perf_counter() - t0:.1f} s", flush=True)
                ref = self.reference(sk.verify, **kwargs)
                same = ((out.accepted_nodes.cpu() == ref.accepted_nodes.cpu()).all(1)
                        & (out.num_accepted.cpu() == ref.num_accepted.cpu())
                        & (out.output_tokens.cpu() == ref.output_tokens.cpu()).all(1))
                self.check(bool(same[greedy].all()), what + ": greedy rows differ")
                self.check(self.valid_path(out, kwargs["tree_tokens"], kwargs["parents"], case[2]),
                           what + ": not a valid path")
                self.sampled_rows += int((~greedy).sum())
                self.sampled_same += int(same[~greedy].sum())

    # ---------------------------------------------------------------- compact_kv_cache_

    def cache(self, batch, cache_len, heads, dim, dtype_name, layout):
        dtype = getattr(self.torch, dtype_name)
        if layout == "hf":
            return self.randn(batch, heads, cache_len, dim, dtype=dtype).transpose(1, 2)
        if layout == "slice":  # odd offsets: only narrow vectors fit
            return self.randn(batch + 1, cache_len + 3, heads + 2, dim + 5, dtype=dtype)[1:, 2:2 + cache_len, 1:1 + heads, 3:3 + dim]
        return self.randn(batch, cache_len, heads, dim, dtype=dtype)

    def accepted_paths(self, parents):
        """accepted_nodes int32 [B, T] (-1 after the path) and num_accepted int32 [B]: each row a
        root-to-node path of its tree (node ids < T), stopping at random."""
        torch = self.torch
        rows = parents.cpu().tolist()
        batch, num_nodes = len(rows), len(rows[0])
        accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
        num = torch.zeros(batch, dtype=torch.int32)
        for b, row in enumerate(rows):
            path = [0]
            while True:
                children = [i for i in range(1, num_nodes) if row[i] == path[-1]]
                if not children or float(torch.rand((), generator=self.gen)) < 0.15:
                    break
                path.append(children[int(self.randint(0, len(children)))])
            accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
            num[b] = len(path) - 1
        return accepted.to(self.device), num.to(self.device)

    def compact(self) -> None:
        torch, sk = self.torch, self.sk
        specs = [(2, 64, "bfloat16", "contiguous"), (4, 8, "float16", "hf"), (1, 5, "float16", "slice"),
                 (3, 64, "float32", "hf"), (2, 7, "bfloat16", "slice")]
        for backend in self.backends("compact_kv_cache_"):
            for num_nodes, kind in ((1, "random"), (8, "random"), (65, "chain"), (128, "random")):
                batch = 4
                cache_len = 40 + num_nodes
                seqlens = torch.tensor([40, 0, 13, cache_len - num_nodes], dtype=torch.int32, device=self.device)
                accepted, num = self.accepted_paths(self.parents(batch, num_nodes, kind))
                caches = [self.cache(batch, cache_len + extra, h, d, dt, layout)
                          for extra, (h, d, dt, layout) in enumerate(specs)]
                copies = [c.clone() for c in caches]
                got = sk.compact_kv_cache_(caches, seqlens, accepted, num, backend=backend)
                want = sk.compact_kv_cache_(copies, seqlens, accepted, num, backend="reference")
                same = torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(caches, copies))
                self.check(same, f"compact_kv_cache_[{backend}] T={num_nodes} {kind}")
            # 300 caches (more than one launch holds), int64 lengths.
            accepted, num = self.accepted_paths(self.parents(3, 6))
            seqlens = torch.tensor([0, 9, 4], dtype=torch.int64, device=self.device)
            caches = [self.cache(3, 15, 1, 8, "float16", "contiguous") for _ in range(300)]
            copies = [c.clone() for c in caches]
            got = sk.compact_kv_cache_(caches, seqlens, accepted, num, backend=backend)
            want = sk.compact_kv_cache_(copies, seqlens, accepted, num, backend="reference")
            same = torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(caches, copies))
            self.check(same, f"compact_kv_cache_[{backend}] 300 caches")

    # ---------------------------------------------------------------- ngram_propose, ngram_propose_tree

    def histories(self):
        """(name, tokens [B, L] on the device, lengths [B]) with edge-case lengths."""
        torch = self.torch
        small = self.randint(0, 5, (5, 3000))
        yield "vocab5", small.to(self.device), torch.tensor([3000, 0, 1, 2, 777], device=self.device)
        big = self.randint(0, 50000, (3, 1500))
        big[0, -4:] = big[0, 100:104]  # one long match
        yield "vocab50k-int32", big.to(torch.int32).to(self.device), torch.tensor([1500, 1500, 1499], device=self.device)
        wide = torch.zeros(4, 2 * 1000, dtype=torch.int64)
        wide[:, ::2] = self.randint(0, 7, (4, 1000))
        yield "strided", wide.to(self.device)[:, ::2], torch.tensor([1000, 3, 999, 500], device=self.device)
        # Every other token is 7 and the others all differ: ~10000 distinct continuations of
        # "7", more than the tree kernel's 2048-slot table holds in one round.
        over = torch.arange(20000, dtype=torch.int64) + 100
        over[::2] = 7
        over[-1] = 7
        yield "overflow", over[None].to(self.device), torch.tensor([20000], device=self.device)

    def ngram(self) -> None:
        torch, sk = self.torch, self.sk
        chain_backends = self.backends("ngram_propose")
        tree_backends = self.backends("ngram_propose_tree")
        for name, tokens, lengths in self.histories():
            for backend in chain_backends:
                for kwargs in (dict(), dict(min_n=2, max_n=5, num_tokens=9, policy="latest"), dict(max_n=1, num_tokens=1)):
                    got = sk.ngram_propose(tokens, lengths, backend=backend, **kwargs)
                    ref = self.reference(sk.ngram_propose, tokens, lengths, **kwargs)
                    self.check(all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref)),
                               f"ngram_propose[{backend}] {name} {kwargs}")
            for backend in tree_backends:
                for kwargs in (dict(tree_width=4), dict(tree_width=8, num_tokens=3, policy="latest"),
                               dict(tree_width=1), dict(tree_width=6, max_nodes=3, min_n=2)):
                    got = sk.ngram_propose_tree(tokens, lengths, backend=backend, **kwargs)
                    ref = self.reference(sk.ngram_propose_tree, tokens, lengths, **kwargs)
                    same = torch.equal(got.tokens.cpu(), ref.tokens.cpu()) and torch.equal(got.parents.cpu(), ref.parents.cpu())
                    self.check(same, f"ngram_propose_tree[{backend}] {name} {kwargs}")

    # ---------------------------------------------------------------- paged caches

    def pages(self, dense, num_tokens, page_size: int, fill: float):
        """dense [B, S, H, D] caches cut into pools [num_pages, page_size, H, D] (one per cache,
        the same pages for all): row b's first ceil(num_tokens[b] / page_size) pages in a
        shuffled order, two spare pages, every slot no row uses set to `fill`. Returns (pools,
        block_table int32 [B, P]) with two padding columns of junk ids (never read)."""
        torch = self.torch
        needed = [-(-int(n) // page_size) for n in num_tokens]
        num_pages = sum(needed) + 2
        order = torch.randperm(num_pages, generator=self.gen).to(torch.int32)
        table = self.randint(-5, 10 * num_pages, (len(needed), max(needed) + 2)).to(torch.int32)
        pools = [torch.full((num_pages, page_size) + tuple(c.shape[2:]), fill, dtype=c.dtype) for c in dense]
        first = 0
        for b, count in enumerate(needed):
            table[b, :count] = order[first:first + count]
            first += count
            pos = torch.arange(int(num_tokens[b]))
            slots = table[b, pos // page_size].long() * page_size + pos % page_size
            for pool, cache in zip(pools, dense):
                pool.view(-1, *pool.shape[2:])[slots] = cache[b, : len(pos)].cpu()
        return [p.to(self.device) for p in pools], table.to(self.device)

    PAGED_ATTENTION_CASES = [  # (T, prefixes, Hq, Hkv, D, dtype name, page size)
        (17, (300, 0, 37), 8, 2, 128, "bfloat16", 16),  # mma, power-of-two pages
        (65, (2000, 1, 129), 8, 1, 64, "float16", 3),  # mma, split-KV, two mask words, pages of 3
        (128, (129, 0, 64), 4, 2, 256, "bfloat16", 1),  # mma, D = 256, T = 128, one slot per page
        (9, (65, 0, 7), 4, 2, 64, "float32", 32),  # SIMT fallback: fp32
        (33, (400, 17, 0), 6, 3, 80, "float16", 5),  # SIMT fallback: D = 80
    ]

    def paged_attention(self) -> None:
        torch, sk = self.torch, self.sk
        for backend in self.backends("tree_attention_paged"):
            for num_nodes, prefixes, hq, hkv, dim, dtype_name, page_size in self.PAGED_ATTENTION_CASES:
                if self.quick and max(prefixes) >= 1000:
                    continue
                q, k, v, mask, seqlens = self.tree_attention_case(num_nodes, prefixes, hq, hkv, dim, dtype_name, "bshd")
                # NaN in every slot no row may read: reading one shows in the output.
                (k_pool, v_pool), table = self.pages([k, v], seqlens.cpu() + num_nodes, page_size, float("nan"))
                for m in (mask, self.reference(sk.pack_tree_mask, mask)):
                    out = sk.tree_attention(q, k_pool, v_pool, m, seqlens, block_table=table, backend=backend)
                    ref = self.reference(sk.tree_attention, q, k, v, m, seqlens)
                    atol, rtol = self.TOL[dtype_name]
                    same = out.shape == ref.shape and bool(torch.isfinite(out).all()) and \
                        torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
                    self.check(same, f"tree_attention_paged[{backend}] T={num_nodes} D={dim} {dtype_name} "
                                     f"page {page_size} {'packed' if m.dtype == torch.int64 else 'bool'}")

    def paged_compact(self) -> None:
        torch, sk = self.torch, self.sk
        specs = [(2, 64, "bfloat16"), (1, 5, "float16"), (3, 64, "float32")]
        for backend in self.backends("compact_kv_cache_paged_"):
            for num_nodes, kind, page_size in ((1, "random", 1), (8, "random", 3), (65, "chain", 16), (128, "random", 5)):
                seqlens = torch.tensor([40, 0, 13, 29], dtype=torch.int32)
                accepted, num = self.accepted_paths(self.parents(len(seqlens), num_nodes, kind))
                dense = [self.randn(len(seqlens), 40 + num_nodes, h, d, dtype=getattr(torch, dt)) for h, d, dt in specs]
                # Finite garbage in the unused slots: whole pools are compared bytewise.
                pools, table = self.pages(dense, seqlens + num_nodes, page_size, 7.0)
                copies = [p.clone() for p in pools]
                seqlens = seqlens.to(self.device)
                got = sk.compact_kv_cache_(pools, seqlens, accepted, num, block_table=table, backend=backend)
                want = sk.compact_kv_cache_(copies, seqlens, accepted, num, block_table=table, backend="reference")
                same = torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(pools, copies))
                self.check(same, f"compact_kv_cache_paged_[{backend}] T={num_nodes} {kind} page {page_size}")


PARTS = ("tree_masks", "tree_attention", "verify", "compact", "ngram", "paged_attention", "paged_compact")


def run_ops(device: str, seed: int = 0, quick: bool = False, parts=PARTS) -> int:
    """Run the cases of `parts` (default every one, in PARTS order) on `device` (quick: without
    the largest vocabularies and prefixes, for the CPU test); returns the exit status (see the
    module docstring). One part per process lets a sanitizer tool run the parts side by side."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"parts: expected a non-empty subset of {PARTS}, got {list(parts)}")
    import torch

    import specdec_kernels as sk

    if device == "cuda" and not torch.cuda.is_available():
        print("sanitize_ops: --device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    missing = [op for op in sk.ops._extension.OPS if device not in sk.available_backends(op, device)]
    if missing and device == "cuda":
        print(f"sanitize_ops: no compiled CUDA kernel for {missing} ({sk.LOAD_ERROR or 'the extension was built without them'}); "
              "build it where torch has CUDA and nvcc is found (tools/gpu_session.sh build)")
        return 2
    if missing:
        print(f"sanitize_ops: note: no compiled {device} kernel for {missing}; those cases check only that the "
              "inputs are valid (reference)")
    runner = Runner(device, torch.Generator().manual_seed(seed), quick)
    start = time.perf_counter()
    for part in [getattr(runner, name) for name in PARTS if name in parts]:
        t0 = time.perf_counter()
        part()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"  {part.__name__}: {time.perf_counter() - t0:.1f} s", flush=True)
    if runner.sampled_rows:
        share = runner.sampled_same / runner.sampled_rows
        print(f"  verify: {runner.sampled_same}/{runner.sampled_rows} sampled rows equal the reference")
        if share < 0.9:  # both read the same uniforms: only fp32 near-ties may differ
            runner.fail(f"verify: only {share:.0%} of sampled rows equal the reference")
    print(f"sanitize_ops: {runner.cases} comparisons on {device} in {time.perf_counter() - start:.1f} s")
    if runner.failures:
        print(f"sanitize_ops: {runner.failures} FAILURES")
        return 1
    print(OK_LINE)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where to run the ops (default: cuda if available, else cpu with a note)")
    parser.add_argument("--seed", type=int, default=0, help="input seed (default 0: sanitizer runs are reproducible)")
    parser.add_argument("--quick", action="store_true",
                        help="skip the largest cases (vocab > 10000, prefix >= 1000): the CPU test's smoke run")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    parser.add_argument("--watchdog", type=float, default=0,
                        help="after this many seconds, print every thread's Python stack (faulthandler) and go on: "
                             "where a run that a sanitizer's timeout will cut is waiting (default 0: off)")
    parser.add_argument("--check-log", nargs=2, metavar=("TOOL", "LOG"),
                        help=f"judge a compute-sanitizer log of TOOL ({', '.join(TOOLS)}) instead of running the ops")
    parser.add_argument("--app-rc", type=int, default=0, help="with --check-log: the exit status of the sanitized run")
    args = parser.parse_args(argv)
    if args.check_log:
        tool, path = args.check_log
        if tool not in TOOLS:
            parser.error(f"--check-log: TOOL must be one of {TOOLS}, got {tool!r}")
        with open(path, errors="replace") as f:
            log = f.read()
        passed, reasons = check_log(tool, log, args.app_rc)
        expected = race_reports(log) if tool == "racecheck" else []
        note = f" ({len(expected)} expected n-gram table report(s))" if expected and passed else ""
        print(f"{tool}: {'PASS' if passed else 'FAIL'}{note}")
        for reason in reasons:
            print(f"  {reason}")
        return 0 if passed else 1
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, exit=False)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            print("sanitize_ops: no CUDA GPU: running the cases on the CPU kernels (--device cuda to insist)")
    parts = tuple(p for p in args.parts.split(",") if p)
    if set(parts) - set(PARTS) or not parts:
        parser.error(f"--parts: expected names from {','.join(PARTS)}, got {args.parts!r}")
    return run_ops(device, args.seed, args.quick, parts)


if __name__ == "__main__":
    sys.exit(main())
