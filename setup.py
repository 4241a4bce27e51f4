"""Builds specdec_kernels._C, the compiled kernels, against the torch already installed.

    pip install --no-build-isolation -e .     # or without -e

--no-build-isolation is required: the extension must be compiled against the exact torch
it will run with, so torch is not a build requirement (pip would fetch a different one).

What gets compiled:
* always the CPU kernels and the op schemas (csrc/*.cpp), as a CppExtension;
* also the CUDA kernels (csrc/cuda/*.cu), as a CUDAExtension, when torch has CUDA and nvcc
  is found. Their GPU tests pass on an H200 (sm_90a, CUDA 13.0, 2026-11-26:
  bench/results/gpu/); sm_80/86/89 compile but have not run on such a GPU.
SPECDEC_FORCE_CPU=1 builds the CPU kernels only, whatever else holds (CUDA tensors then run
the Triton kernels, or the reference).

GPU targets: sm_80, sm_86, sm_89 and sm_90a (TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0a"),
chosen here rather than left to torch, whose default without a visible GPU includes sm_75
(and, with a GPU, builds for that GPU only). The kernels need sm_80 for their fast paths
(cp.async, bf16 mma.sync, warp reductions). TORCH_CUDA_ARCH_LIST overrides the list, e.g.
TORCH_CUDA_ARCH_LIST=9.0a for a quick Hopper-only build; an older GPU in it (7.5) builds, and
runs the fallback paths (tree attention's SIMT kernel, verify's per-lane histogram atomics).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup


def set_cuda_home_from_nvcc():
    """Point CUDA_HOME at the toolkit of the nvcc on PATH, as nvcc itself reports it (TOP in
    its --dryrun output), when neither CUDA_HOME nor CUDA_PATH is set. torch takes nvcc's
    grandparent directory instead, which is wrong for a wrapper script such as
    /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc (this project's machines):
    everything compiles, then the link looks for libcudart in /usr/local/lib and fails."""
    nvcc = shutil.which("nvcc")
    if nvcc is None or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    try:
        dryrun = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return  # torch's own guess stands
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        if line.startswith("#$ TOP="):
            os.environ["CUDA_HOME"] = os.path.realpath(line[len("#$ TOP="):].strip())
            return


try:
    import torch

    set_cuda_home_from_nvcc()  # before cpp_extension reads CUDA_HOME (at import)
    from torch.utils import cpp_extension
except ImportError as error:
    sys.exit(
        f"specdec-kernels: cannot import torch ({error}). specdec_kernels._C is built against the "
        "installed torch: install torch first (e.g. `pip install torch`), then build with "
        "`pip install --no-build-isolation -e .` (without --no-build-isolation, pip builds in a "
        "fresh environment that has no torch)."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCH_LIST = "8.0;8.6;8.9;9.0a"


def find_nvcc():
    """Path to the nvcc that torch's build helpers would use, or None."""
    if cpp_extension.CUDA_HOME is not None:
        nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
        if os.path.exists(nvcc):
            return nvcc
    return shutil.which("nvcc")


def why_no_cuda():
    """Why the CUDA kernels are not compiled, or None if they are."""
    if os.environ.get("SPECDEC_FORCE_CPU") == "1":
        return "SPECDEC_FORCE_CPU=1 is set"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if find_nvcc() is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def extension():
    # Sources relative to setup.py, as setuptools wants them.
    sources = sorted(glob.glob("csrc/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    # -O3 for speed; -g0 overrides the -g that Python's own CFLAGS add (faster build, smaller .so).
    extra_compile_args = {"cxx": ["-O3", "-g0"]}
    extra_link_args = []
    if "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux"):
        # at::parallel_for is an inline `#pragma omp parallel` loop in torch's headers: without
        # -fopenmp it silently runs on one thread. Linking resolves to the libgomp torch loads.
        extra_compile_args["cxx"].append("-fopenmp")
        extra_link_args.append("-fopenmp")
    if sys.platform.startswith("linux"):
        # Keep the symbols of static libraries private. A g++ that has only libstdc++.a (the GPU
        # machines' /opt/gcc g++ 13.3) links a private C++ runtime into _C and, without this,
        # exports it (__cxa_throw, __gxx_personality_v0, ...): an exception from libc10 (every
        # failing TORCH_CHECK) then meets two runtimes and the process segfaults.
        # bench/results/gpu/throw_probe/ has the measurement.
        extra_link_args.append("-Wl,--exclude-libs,ALL")
    reason = why_no_cuda()
    if reason is not None:
        print(f"specdec-kernels: building CPU kernels only: {reason}.")
        return cpp_extension.CppExtension(
            "specdec_kernels._C", sources, include_dirs=include_dirs, extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
        )
    # torch's BuildExtension reads the list from the environment when it compiles.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
    print(f"specdec-kernels: building CPU and CUDA kernels (nvcc: {find_nvcc()}, torch CUDA {torch.version.cuda}, "
          f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}).")
    # -lineinfo maps SASS to source lines for compute-sanitizer and ncu reports (no effect
    # on the generated code); tools/sanitize_ops.py matches the one expected racecheck
    # report by file:line.
    extra_compile_args["nvcc"] = ["-O3", "-lineinfo"]
    return cpp_extension.CUDAExtension(
        "specdec_kernels._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")),
        include_dirs=include_dirs,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
