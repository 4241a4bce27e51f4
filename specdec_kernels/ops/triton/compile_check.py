"""Compile the Triton kernels for sm_80 and sm_90 without a GPU (triton's bundled ptxas).

    python -m specdec_kernels.ops.triton.compile_check          # prints one JSON line per config

The interpreter cannot catch GPU code-generation problems (types, layouts, shared memory),
so this lowers every configuration the tree_attention and verify wrappers launch to a cubin
and reports its shared memory against the per-block limit, and the registers and spill bytes
`ptxas -v` reports (reported, not failed on: they depend on the Triton version). Run it in a process without
TRITON_INTERPRET=1 (triton's own helpers are interpreted there and cannot be compiled).
"""

import inspect
import json
import os
import sys

import torch

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # opt-in maximum per block: A100, H100
ELEMENT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (arch, dtype, head_dim, rows = T * group, packed mask, splits[, page size of a paged cache
#  [, value head dim, sliding window on, softcap on]])
SPLIT_CASES = [
    (90, torch.bfloat16, 128, 64 * 4, True, 8),
    (90, torch.bfloat16, 128, 4, False, 33),
    (90, torch.bfloat16, 256, 16, True, 1),
    (90, torch.float16, 64, 128 * 8, True, 2),
    (80, torch.float16, 64, 17 * 4, False, 1),
    (80, torch.bfloat16, 128, 16 * 4, True, 4),
    (80, torch.float32, 128, 4, False, 4),
    (80, torch.float32, 256, 64, True, 2),
    (90, torch.bfloat16, 128, 64 * 4, True, 8, 16),  # paged caches (tree_attention_paged)
    (90, torch.float16, 64, 11 * 3, False, 1, 3),
    (80, torch.bfloat16, 128, 16 * 4, True, 4, 64),
    (80, torch.float32, 64, 4, True, 2, 32),
    (90, torch.bfloat16, 192, 16 * 4, True, 4, 0, 128, False, False),  # MLA (DeepSeek-V3: D 192, Dv 128)
    (90, torch.bfloat16, 256, 8 * 2, True, 2, 0, 256, True, True),  # Gemma 2 (window and softcap)
    (80, torch.float16, 128, 64 * 4, False, 8, 16, 128, True, False),  # Mistral / Gemma 3 local layers, paged
    (80, torch.bfloat16, 192, 16 * 4, True, 1, 16, 128, True, True),
]
COMBINE_CASES = [(90, torch.bfloat16, 128, 33), (80, torch.float32, 256, 2)]
# verify: (arch, logits dtype, draft_probs dtype or None, vocab, nodes)
VERIFY_CASES = [
    (90, torch.bfloat16, None, 152064, 9),
    (90, torch.bfloat16, torch.float32, 128256, 64),
    (90, torch.float16, torch.float16, 32000, 16),
    (80, torch.float32, None, 32003, 5),
    (80, torch.bfloat16, torch.bfloat16, 152064, 64),
]


def _compile(kernel, pointer_types, constexprs, arch, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.fn
    signature = {}
    for name in inspect.signature(fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name in ("qk_scale", "softcap") else "i32"
    return triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)


def check_split(arch, dtype, head_dim, rows, packed, num_splits, page_size=0, value_dim=None, window=False,
                softcap=False):
    import triton

    from . import tree_attention as ta

    value_dim = value_dim or head_dim
    block_m, block_n, block_d, num_warps, num_stages = ta.launch_config(dtype, max(head_dim, value_dim), rows)
    elt = ELEMENT[dtype]
    pointers = {"q_ptr": f"*{elt}", "k_ptr": f"*{elt}", "v_ptr": f"*{elt}", "mask_ptr": "*i64" if packed else "*u8",
                "seqlens_ptr": "*i32", "out_ptr": f"*{elt}", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                "bt_ptr": "*i32", "depth_ptr": "*i32"}
    constexprs = dict(GROUP=4, BLOCK_M=block_m,  # (the split count is a runtime argument: one kernel for all)
                      BLOCK_N=block_n, BLOCK_D=block_d, PACKED=packed,
                      PRECISION="ieee" if dtype == torch.float32 else None,
                      PAGED=page_size > 0, PAGE_SIZE=max(1, page_size),
                      BLOCK_DV=max(16, triton.next_power_of_2(value_dim)), WINDOW=window, SOFTCAP=softcap)
    compiled = _compile(ta._split_kernel, pointers, constexprs, arch, num_warps=num_warps, num_stages=num_stages)
    n_regs, n_spills = _ptxas_usage(compiled, arch)
    return dict(kernel="split", arch=arch, dtype=ELEMENT[dtype], head_dim=head_dim, rows=rows, packed=packed,
                splits=num_splits, page_size=page_size or None, value_dim=value_dim, window=window, softcap=softcap,
                block=[block_m, block_n, block_d], num_warps=num_warps, num_stages=num_stages,
                shared=compiled.metadata.shared, shared_limit=SHARED_LIMIT[arch], n_regs=n_regs, n_spills=n_spills)


def check_combine(arch, dtype, head_dim, num_splits):
    import triton

    from . import tree_attention as ta

    block_d = max(16, triton.next_power_of_2(head_dim))
    pointers = {"out_ptr": f"*{ELEMENT[dtype]}", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    constexprs = dict(GROUP=4, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    compiled = _compile(ta._combine_kernel, pointers, constexprs, arch, num_warps=4)
    return dict(kernel="combine", arch=arch, dtype=ELEMENT[dtype], head_dim=head_dim, splits=num_splits,
                shared=compiled.metadata.shared, shared_limit=SHARED_LIMIT[arch])


def _ptxas_usage(compiled, arch):
    """(registers, spill bytes) from `ptxas -v` on the kernel's PTX (triton fills n_regs/n_spills
    only when it loads the cubin on a GPU); (None, None) where ptxas cannot be found."""
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except Exception:
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        sm = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        result = subprocess.run([ptxas, "-v", f"-arch={sm}", path, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True)
    text = result.stdout + result.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return (int(regs.group(1)) if regs else None), (max(spills) if spills else None)


def check_verify(arch, dtype, q_dtype, vocab, num_nodes):
    import triton

    from . import verify as vf

    block_v, num_warps = vf.launch_config(vocab)
    elt = ELEMENT[dtype]
    pointers = {"logits_ptr": f"*{elt}", "tokens_ptr": "*i64", "parents_ptr": "*i64",
                "q_ptr": f"*{ELEMENT[q_dtype or dtype]}", "temp_ptr": "*fp32", "top_k_ptr": "*i64",
                "top_p_ptr": "*fp32", "seed_ptr": "*i64", "accepted_ptr": "*i32", "num_accepted_ptr": "*i32",
                "out_tokens_ptr": "*i64"}
    constexprs = dict(HAS_Q=q_dtype is not None, BLOCK_V=block_v, BLOCK_T=max(2, triton.next_power_of_2(num_nodes)),
                      ACCURATE_LOG=True)
    compiled = _compile(vf._verify_kernel, pointers, constexprs, arch, num_warps=num_warps)
    n_regs, n_spills = _ptxas_usage(compiled, arch)
    return dict(kernel="verify", arch=arch, dtype=elt, draft_probs=ELEMENT.get(q_dtype), vocab=vocab, nodes=num_nodes,
                block_v=block_v, num_warps=num_warps, shared=compiled.metadata.shared,
                shared_limit=SHARED_LIMIT[arch], n_regs=n_regs, n_spills=n_spills)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the interpreter cannot compile kernels)", file=sys.stderr)
        return 2
    failed = 0
    checks = {"split": check_split, "combine": check_combine, "verify": check_verify}
    cases = [("split", c) for c in SPLIT_CASES] + [("combine", c) for c in COMBINE_CASES]
    cases += [("verify", c) for c in VERIFY_CASES]
    only = sys.argv[1:]  # optional kernel names to check, e.g. `verify`
    for case in cases:
        kind, args = case
        if only and kind not in only:
            continue
        try:
            result = checks[kind](*args)
            result["ok"] = result["shared"] <= result["shared_limit"]
        except Exception as error:  # report every config, then fail
            result = dict(kernel=kind, case=[str(a) for a in args], ok=False, error=f"{type(error).__name__}: {error}"[:2000])
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
