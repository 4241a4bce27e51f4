"""GPU checks that the test suite does not make: one CUDA graph of a whole verify step, and every
op under torch.compile(fullgraph=True) with inductor, on CUDA tensors.

    python tools/graph_checks.py                    # both (needs a CUDA GPU; skips with a message without)
    python tools/graph_checks.py --only graph       # or: --only compile
    python tools/graph_checks.py --device cpu --only compile --compile-backend aot_eager   # the CPU smoke run

graph: a small random Llama (transformers' LlamaForCausalLM, 4 layers, bf16, GQA, head dim
64) in a `TreeKVCache`, prefilled with ragged histories. One step = tree_mask + pack_tree_mask
of the step's tree, the model forward over the tree with `specdec_tree` attention (our
tree_attention in every layer), verify (greedy and sampled rows), compact_kv_cache_ over every
layer's keys and values. It is captured once into a CUDA graph, then replayed 3 times with new
inputs written into the captured tensors (tokens, tree shape, prefix lengths, seeds, and
temperature / top-k / top-p, so rows switch between greedy and sampled); each replay must
give what the same step gives eagerly from the same cache state: the same verify outputs and
new lengths, caches equal, logits close.

compile: each public op (tree_mask + pack_tree_mask, tree_attention bool and packed,
verify greedy and sampled with [B] seeds and with an int seed, compact_kv_cache_,
ngram_propose + ngram_propose_tree) inside a small function compiled with fullgraph=True (a
graph break is an error), run on two input shapes, equal to eager (in-place ops mutate the
same way).

Each check runs under --check-timeout (default 120 s): one that is still running then (e.g.
an inductor compile that does not end) fails alone and the next one runs. The limit interrupts
Python code only: a kernel that hangs is stopped by the caller's limit (gpu_session.sh).

Exit status: 0 every check passed or the device is absent (a "skipped" line says so); 1 a
check failed (each failure is printed with its traceback).
"""

import argparse
import contextlib
import signal
import sys
import threading
import time
import traceback


def _llama(device, dtype, vocab=32000):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def verify_step(device: str, dtype_name: str = "bfloat16", max_prefix: int = 700, vocab: int = 32000):
    """A prefilled random Llama with tree attention and its verify step (see the docstring):
    returns (step, load, random_inputs, cache, exit_stack). step(x) runs the whole step on the
    inputs x (a dict of tensors); load(x, static=None) restores the cache to its prefilled state
    with x's prefix lengths (and copies x into the tensors of `static`); random_inputs() draws
    new inputs. Close exit_stack when done (it leaves tree attention and no_grad)."""
    import contextlib

    import torch

    import specdec_kernels as sk
    from specdec_kernels.loop.hf.attention import forward, prefill, use_tree_attention
    from specdec_kernels.loop.hf.cache import TreeKVCache

    batch, num_nodes, capacity = 4, 24, 1024
    model = _llama(device, getattr(torch, dtype_name), vocab)
    gen = torch.Generator().manual_seed(1)

    def random_inputs():
        parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
        for b in range(batch):
            real = int(torch.randint(1, num_nodes + 1, (), generator=gen))
            for i in range(1, real):
                parents[b, i] = int(torch.randint(0, i, (), generator=gen))
        tokens = torch.stack([torch.randperm(vocab, generator=gen)[:num_nodes] for _ in range(batch)])
        tokens = torch.where((parents >= 0) | (torch.arange(num_nodes) == 0), tokens, -1)
        prefix = torch.randint(1, max_prefix + 1, (batch,), generator=gen).to(torch.int32)
        # Each row greedy or sampled anew (row 0 always greedy, row 1 always sampled): the
        # graph must read these at replay, not keep what the captured inputs held.
        sampled = torch.rand(batch, generator=gen) < 0.5
        sampled[0], sampled[1] = False, True
        temperature = torch.where(sampled, torch.rand(batch, generator=gen) + 0.3, 0.0)
        top_k = torch.where(torch.rand(batch, generator=gen) < 0.5, torch.randint(1, 100, (batch,), generator=gen), 0)
        top_p = torch.where(torch.rand(batch, generator=gen) < 0.5, torch.rand(batch, generator=gen) * 0.7 + 0.3, 1.0)
        return dict(tokens=tokens.to(device), parents=parents.to(device), prefix=prefix.to(device),
                    temperature=temperature.to(device), top_k=top_k.to(device), top_p=top_p.to(device),
                    seed=torch.randint(0, 2**62, (batch,), generator=gen).to(device))

    stack = contextlib.ExitStack()
    stack.enter_context(use_tree_attention(model))
    stack.enter_context(torch.no_grad())
    cache = TreeKVCache.for_model(model, batch, capacity)
    history = torch.randint(0, vocab, (batch, max_prefix + 1), generator=gen).to(device)
    prefill(model, cache, history, torch.full((batch,), max_prefix + 1, device=device))
    snapshot = [buf.clone() for buf in cache.buffers()]
    # The views handed to attention are max_len + T long (a host int): fixed for the graph;
    # every row's own length comes from cache.seqlens, a tensor only ever updated in place.
    cache.max_len = max_prefix

    def step(x):
        mask = sk.pack_tree_mask(sk.tree_mask(x["parents"]))
        positions = sk.TokenTree(x["tokens"], x["parents"]).position_ids(cache.seqlens)
        logits = forward(model, cache, x["tokens"], positions, tree_mask=mask)
        out = sk.verify(logits, x["tokens"], x["parents"], temperature=x["temperature"], top_k=x["top_k"],
                        top_p=x["top_p"], seed=x["seed"])
        new_lens = sk.compact_kv_cache_(cache.buffers(), cache.seqlens, out.accepted_nodes, out.num_accepted)
        return logits, out.accepted_nodes, out.num_accepted, out.output_tokens, new_lens

    def load(x, static=None):
        for buf, saved in zip(cache.buffers(), snapshot):
            buf.copy_(saved)
        cache.seqlens.copy_(x["prefix"])
        if static is not None:
            for name, value in x.items():
                static[name].copy_(value)

    return step, load, random_inputs, cache, stack


def check_graph(device: str) -> None:
    """Capture one verify step into a CUDA graph and replay it on new inputs (see the docstring)."""
    import torch

    import specdec_kernels as sk

    step, load, random_inputs, cache, stack = verify_step(device)
    with stack:
        static = random_inputs()
        load(static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), sk.config.value_checks(False):
            step(static)  # warm-up: kernels loaded, workspaces allocated, autotuning done
        torch.cuda.current_stream().wait_stream(side)
        load(static)
        graph = torch.cuda.CUDAGraph()
        with sk.config.value_checks(False), torch.cuda.graph(graph):
            captured = step(static)
        for replay in range(3):
            x = random_inputs()
            load(x)
            expected = [t.clone() for t in step(x)]  # eager, value checks on
            expected_caches = [buf.clone() for buf in cache.buffers()]
            load(x, static)
            graph.replay()
            torch.cuda.synchronize()
            names = ("logits", "accepted_nodes", "num_accepted", "output_tokens", "new_lens")
            for name, got, want in zip(names, captured, expected):
                if name == "logits":
                    print(f"  graph replay {replay}: logits max |diff| {float((got - want).abs().max()):.2e}")
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
                else:
                    assert torch.equal(got, want), f"replay {replay}: {name} differs: {got.tolist()} vs {want.tolist()}"
            for i, (got, want) in enumerate(zip(cache.buffers(), expected_caches)):
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"replay {replay}: cache {i}")
            print(f"  graph replay {replay}: accepted {captured[2].tolist()} == eager")


def compile_cases(device: str):
    """(name, fn, [args for two shapes]) around each public op, on `device`."""
    import torch

    import specdec_kernels as sk

    gen = torch.Generator().manual_seed(2)

    def parents(batch, num_nodes):
        out = torch.full((batch, num_nodes), -1, dtype=torch.int64)
        for b in range(batch):
            for i in range(1, num_nodes - b):
                out[b, i] = int(torch.randint(0, i, (), generator=gen))
        return out.to(device)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    def f_tree(p):
        mask = sk.tree_mask(p)
        return mask, sk.pack_tree_mask(mask)

    def f_attention(q, k, v, p, prefix):
        mask = sk.tree_mask(p)
        return sk.tree_attention(q, k, v, mask, prefix), sk.tree_attention(q, k, v, sk.pack_tree_mask(mask), prefix, scale=0.1)

    def attention_args(num_nodes):
        prefix = torch.tensor([100, 0, 37], dtype=torch.int32, device=device)
        k = randn(3, 2, 100 + num_nodes, 64).transpose(1, 2)
        v = randn(3, 2, 100 + num_nodes, 64).transpose(1, 2)
        return (randn(3, num_nodes, 8, 64), k, v, parents(3, num_nodes), prefix)

    def f_verify(logits, tokens, p, probs, seed):
        greedy = sk.verify(logits, tokens, p, temperature=0.0, seed=seed)
        sampled = sk.verify(logits, tokens, p, draft_probs=probs, temperature=0.8, top_k=40, top_p=0.9, seed=seed)
        return greedy.accepted_nodes, greedy.output_tokens, sampled.accepted_nodes, sampled.output_tokens

    def f_verify_int_seed(logits, tokens, p, probs, seed):
        return f_verify(logits, tokens, p, probs, 7)  # the per-row seeds derived in the graph (Philox)

    def verify_args(num_nodes):
        vocab = 5003
        tokens = torch.stack([torch.randperm(vocab, generator=gen)[:num_nodes] for _ in range(3)]).to(device)
        probs = torch.softmax(randn(3, num_nodes, vocab, dtype=torch.float32), -1)
        seed = torch.randint(0, 2**62, (3,), generator=gen).to(device)
        return (randn(3, num_nodes, vocab) * 3, tokens, parents(3, num_nodes), probs, seed)

    def f_compact(c0, c1, prefix, accepted, num):
        return sk.compact_kv_cache_([c0, c1], prefix, accepted, num) * 2

    def compact_args(num_nodes):
        accepted = torch.full((2, num_nodes), -1, dtype=torch.int32)
        accepted[0, :3] = torch.tensor([0, 1, num_nodes - 1])
        accepted[1, 0] = 0
        return (randn(2, 20 + num_nodes, 2, 64), randn(2, 2, 20 + num_nodes, 64).transpose(1, 2),
                torch.tensor([4, 20], dtype=torch.int32, device=device), accepted.to(device),
                torch.tensor([2, 0], dtype=torch.int32, device=device))

    def f_ngram(tokens, lengths):
        drafts, lens = sk.ngram_propose(tokens, lengths, min_n=1, max_n=3, num_tokens=4)
        tree = sk.ngram_propose_tree(tokens, lengths, min_n=1, max_n=3, num_tokens=4, tree_width=3, policy="latest")
        return drafts, lens, tree.tokens, tree.parents

    def ngram_args(length):
        return (torch.randint(0, 6, (3, length), generator=gen).to(device), torch.tensor([length, 0, length // 2], device=device))

    return [
        ("tree_mask+pack_tree_mask", f_tree, [(parents(3, t),) for t in (17, 130)]),
        ("tree_attention", f_attention, [attention_args(t) for t in (9, 65)]),
        ("verify", f_verify, [verify_args(t) for t in (6, 17)]),
        ("compact_kv_cache_", f_compact, [compact_args(t) for t in (5, 9)]),
        ("ngram_propose+ngram_propose_tree", f_ngram, [ngram_args(n) for n in (300, 5000)]),
        # The row seeds derived from an int (a Philox draw): inductor did not finish compiling
        # them inline in 10 minutes, hence their own op (philox.seeds_from_int); kept last.
        ("verify with an int seed", f_verify_int_seed, [verify_args(t) for t in (6, 17)]),
    ]


class CheckTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise CheckTimeout in the block after `seconds` (SIGALRM; 0 = no limit). Not applied off
    the main thread, nor over an alarm someone else set (pytest-timeout's, in the test suite)."""
    if (not seconds or threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"still running after {seconds} s: stopped (--check-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _clone(args):
    return tuple(a.clone() if hasattr(a, "clone") else a for a in args)


def check_compile(device: str, backend: str, name: str, fn, arg_sets) -> None:
    """fn compiled with fullgraph=True equals fn eager on every argument set."""
    import torch

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    for args in arg_sets:
        eager_args, compiled_args = _clone(args), _clone(args)
        want, got = fn(*eager_args), compiled(*compiled_args)
        want = want if isinstance(want, tuple) else (want,)
        got = got if isinstance(got, tuple) else (got,)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            torch.testing.assert_close(x, y, atol=1e-2 if x.is_floating_point() else 0, rtol=1e-2 if x.is_floating_point() else 0)
        for x, y in zip(compiled_args, eager_args):  # in-place ops mutate the same way
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), f"{name}: an argument was mutated differently"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("graph", "compile"), default=None, help="run one of the two checks")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu runs the compile check only, as a smoke test")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--check-timeout", type=int, default=120, metavar="S",
                        help="seconds one check may run before it fails (default 120; 0 = no limit)")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("graph_checks: skipped: no CUDA GPU (torch.cuda.is_available() is False)")
        return 0
    import specdec_kernels as sk

    if args.device == "cuda":
        missing = [op for op in sk.ops._extension.OPS if "cuda" not in sk.available_backends(op, "cuda")]
        if missing:
            print(f"graph_checks: note: no compiled CUDA kernel for {missing}: those ops run their Triton or reference "
                  "implementation here")
    checks = []
    if args.only in (None, "graph"):
        if args.device == "cuda":
            checks.append(("cuda graph of a verify step", lambda: check_graph(args.device)))
        else:
            print("graph_checks: the CUDA-graph check needs --device cuda: skipped")
    if args.only in (None, "compile"):
        for name, fn, arg_sets in compile_cases(args.device):
            if args.device == "cpu":
                arg_sets = arg_sets[:1]  # a smoke run: one shape (the GPU run also checks a second one)
            checks.append((f"torch.compile(fullgraph=True, backend={args.compile_backend}) {name}",
                           lambda n=name, f=fn, a=arg_sets: check_compile(args.device, args.compile_backend, n, f, a)))
    failures = 0
    for name, check in checks:
        start = time.perf_counter()
        try:
            with time_limit(args.check_timeout):
                check()
            print(f"PASS {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:  # report every check, then fail
            failures += 1
            print(f"FAIL {name} ({time.perf_counter() - start:.1f} s)\n{traceback.format_exc()}", flush=True)
    print(f"graph_checks: {len(checks) - failures}/{len(checks)} passed on {args.device}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
