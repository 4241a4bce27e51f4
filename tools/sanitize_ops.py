"""Run every CUDA op once on small inputs, for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck  python tools/sanitize_ops.py
    compute-sanitizer --tool racecheck python tools/sanitize_ops.py

Shapes are small (sanitizer runs are ~100x slower) but cover the paths the kernels branch on:
ragged prefixes incl. 0, trees of 1 / 17 / 70 nodes (two mask words), GQA, bf16 / fp16 / fp32,
HF-layout views, greedy and sampled verify rows with and without draft probabilities, odd
vocabulary sizes, n-gram chains and trees on short and empty rows. Each op runs with
backend="cuda" (and "triton" when triton imports); results are checked against the reference
so a sanitizer-clean but wrong kernel still fails.
"""

import sys

import torch

import specdec_kernels as sk


def backends(op):
    found = sk.available_backends(op, "cuda")
    return [b for b in ("cuda", "triton") if b in found]


def random_parents(num_nodes, gen):
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, num_nodes)]
    return torch.tensor(parents, device="cuda")


def tree_attention_cases(gen):
    for num_nodes, prefix, (hq, hkv, d), dtype in [
        (1, 0, (4, 4, 64), torch.bfloat16),
        (17, 37, (8, 2, 128), torch.float16),
        (70, 300, (8, 1, 64), torch.bfloat16),
        (5, 129, (4, 2, 256), torch.float16),
        (9, 65, (4, 2, 64), torch.float32),
    ]:
        batch = 3
        cap = prefix + num_nodes + 7
        q = torch.randn(batch, num_nodes, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(batch, hkv, cap, d, device="cuda", dtype=dtype).transpose(1, 2)  # HF-layout view
        v = torch.randn(batch, hkv, cap, d, device="cuda", dtype=dtype).transpose(1, 2)
        seqlens = torch.tensor([prefix, prefix // 2, 0], dtype=torch.int32, device="cuda")
        mask = sk.tree_mask(random_parents(num_nodes, gen))
        yield q, k, v, mask, seqlens


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_ops: needs a CUDA GPU")
        return 2
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for backend in backends("tree_attention"):
        for q, k, v, mask, seqlens in tree_attention_cases(gen):
            for m in (mask, sk.pack_tree_mask(mask)):
                out = sk.tree_attention(q, k, v, m, seqlens, backend=backend)
                ref = sk.tree_attention(q, k, v, m, seqlens, backend="reference")
                if not torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2):
                    print(f"tree_attention[{backend}] mismatch for q {tuple(q.shape)} {q.dtype}")
                    failures += 1
    for backend in backends("verify"):
        for num_nodes, vocab, with_probs in [(1, 1000, False), (6, 32003, True), (17, 5003, False), (70, 4099, True)]:
            batch = 4
            parents = random_parents(num_nodes, gen)
            logits = torch.randn(batch, num_nodes, vocab, device="cuda", dtype=torch.bfloat16) * 3
            tokens = torch.randint(0, vocab, (batch, num_nodes), device="cuda")
            probs = torch.softmax(torch.randn(batch, num_nodes, vocab, device="cuda"), -1) if with_probs else None
            if not with_probs:  # deterministic drafts: distinct siblings
                tokens = torch.arange(num_nodes, device="cuda").expand(batch, -1).contiguous()
            temperature = torch.tensor([0.0, 0.7, 1.0, 1.3], device="cuda")
            kwargs = dict(draft_probs=probs, temperature=temperature, top_k=torch.tensor([0, 50, 0, 7], device="cuda"),
                          top_p=torch.tensor([1.0, 0.9, 1.0, 0.5], device="cuda"), seed=1234)
            out = sk.verify(logits, tokens, parents, backend=backend, **kwargs)
            ref = sk.verify(logits, tokens, parents, backend="reference", **kwargs)
            if not torch.equal(out.accepted_nodes[0], ref.accepted_nodes[0]):  # row 0 is greedy: exact
                print(f"verify[{backend}] greedy row mismatch (T={num_nodes}, V={vocab})")
                failures += 1
    for backend in backends("ngram_propose") + [b for b in backends("ngram_propose_tree") if b == "cuda"]:
        tokens = torch.randint(0, 5, (4, 3000), device="cuda")
        lengths = torch.tensor([3000, 0, 1, 777], device="cuda")
        if backend in backends("ngram_propose"):
            got = sk.ngram_propose(tokens, lengths, backend=backend)
            ref = sk.ngram_propose(tokens, lengths, backend="reference")
            failures += int(not all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref)))
        if backend in backends("ngram_propose_tree"):
            got = sk.ngram_propose_tree(tokens, lengths, tree_width=4, backend=backend)
            ref = sk.ngram_propose_tree(tokens, lengths, tree_width=4, backend="reference")
            failures += int(not (torch.equal(got.tokens.cpu(), ref.tokens.cpu()) and torch.equal(got.parents.cpu(), ref.parents.cpu())))
    for backend in backends("compact_kv_cache_"):
        caches = [torch.randn(3, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        copies = [c.clone() for c in caches]
        seqlens = torch.tensor([10, 0, 40], dtype=torch.int32, device="cuda")
        accepted = torch.tensor([[0, 2, 5, -1], [0, 1, 2, 3], [0, -1, -1, -1]], dtype=torch.int32, device="cuda")
        num = torch.tensor([2, 3, 0], dtype=torch.int32, device="cuda")
        sk.compact_kv_cache_(caches, seqlens, accepted, num, backend=backend)
        sk.compact_kv_cache_(copies, seqlens, accepted, num, backend="reference")
        failures += int(not all(torch.equal(a, b) for a, b in zip(caches, copies)))
    torch.cuda.synchronize()
    print(f"sanitize_ops: {'ok' if failures == 0 else f'{failures} FAILURES'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
