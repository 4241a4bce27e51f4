"""Run one throw case in this process: `probe.py build NAME LDFLAGS` compiles probe_op.{cpp,cu}
into build dir NAME; `probe.py call NAME cpu|cuda` loads it and calls the failing op;
`probe.py specdec cpu|cuda` makes our _C's verify op fail its dtype check."""
import os, sys
import torch

here = os.path.dirname(os.path.abspath(__file__))
what = sys.argv[1]
if what == "build":
    from torch.utils import cpp_extension
    name, ldflags = sys.argv[2], sys.argv[3].split()
    d = os.path.join("/tmp/throw_probe", name); os.makedirs(d, exist_ok=True)
    cpp_extension.load(name="throw_probe_" + name, sources=[f"{here}/probe_op.cpp", f"{here}/probe_op.cu"],
                       build_directory=d, extra_ldflags=ldflags, is_python_module=False, verbose=False)
    print("built", name)
elif what == "call":
    name, device = sys.argv[2], sys.argv[3]
    import glob
    torch.ops.load_library(glob.glob(f"/tmp/throw_probe/{name}/*.so")[0])
    try:
        torch.ops.throw_probe.fail(torch.zeros(2, device=device))
    except RuntimeError as e:
        print("RAISED OK:", str(e).splitlines()[0])
else:
    device = sys.argv[2]
    import specdec_kernels  # noqa: F401 (registers torch.ops.specdec)
    z = lambda *s, **k: torch.zeros(*s, device=device, **k)
    ones = torch.ones(2, device=device)
    try:
        torch.ops.specdec.verify.default(torch.randn(2, 3, 11, device=device), z(2, 3, dtype=torch.int32),
                                         torch.tensor([[-1, 0, 1]] * 2, device=device), None, ones,
                                         z(2, dtype=torch.int64), ones, z(2, dtype=torch.int64))
    except RuntimeError as e:
        print("RAISED OK:", str(e).splitlines()[0])
