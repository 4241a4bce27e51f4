"""pytest plugin: `--gpu-only` keeps the test cases that exercise a GPU, for the device window's
test stage (tools/gpu_session.sh): the rest of the suite is CPU code that CI runs on every
commit, and the device minutes are too few to run it again there.

    PYTHONPATH=tools python -m pytest -p pytest_gpu_only --gpu-only python_tests
    PYTHONPATH=tools python -m pytest -p pytest_gpu_only --gpu-only --not-passed-in JUNIT python_tests
    python tools/pytest_gpu_only.py summary JUNIT          # one line: passed / failed / errors / skipped
    python tools/pytest_gpu_only.py merge OUT JUNIT...     # one junit.xml from several (the no-xdist fallback)
    python tools/pytest_gpu_only.py split K FILE...        # K groups of test files of about equal size

`--not-passed-in JUNIT` (the window's second call: tools/gpu_session.sh call2) also drops the
cases that passed in the run JUNIT records: what failed, errored, was skipped or never ran
(the first call's time limit) runs again.

A test case is kept when any of these holds (decided from names and markers, so every xdist
worker keeps the same cases, and a machine without a GPU keeps the same ones as one with):
  * its file is a CUDA or Triton test file: test_*_cuda.py, test_*_triton.py;
  * it carries the `gpu` marker (conftest.cuda_kernel_marks);
  * it carries a skipif marker whose reason names CUDA or a GPU (conftest.requires_cuda and
    the like: on the GPU the condition is false but the marker is still there);
  * its parameters (the [...] of its id) or its function name name cuda, triton or gpu.
Left out: test_gpu_tools.py (it tests these tools, which the sanitize and graphs stages run for
real) and test_interpreter_tests_in_a_fresh_process (on a GPU machine it runs the Triton
interpreter tests in a CPU-only child process: minutes of CPU work that CI does). A case that finds out about the GPU only inside its body is not seen: such cases
run in CI on the CPU, and docs/gpu.md lists this as not verified on the GPU.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

GPU_FILE = re.compile(r"^test_\w+_(cuda|triton)\.py$")
GPU_WORD = re.compile(r"cuda|triton|gpu", re.IGNORECASE)
GPU_REASON = re.compile(r"CUDA|GPU")
LEFT_OUT_FILES = ("test_gpu_tools.py",)
LEFT_OUT_FUNCTIONS = ("test_interpreter_tests_in_a_fresh_process",)


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true", default=False,
                     help="keep only the test cases that exercise a GPU (tools/pytest_gpu_only.py)")
    parser.addoption("--not-passed-in", default=None, metavar="JUNIT",
                     help="drop the test cases that passed in the run this junit.xml records")


def junit_key(nodeid: str) -> tuple:
    """(classname, name) of a test id as pytest's junit.xml writes them (its mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def junit_outcomes(path: str) -> dict:
    """{(classname, name): "passed" | "failed" | "error" | "skipped"} of every case in a junit.xml."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("failed" if "failure" in tags else "error" if "error" in tags
                   else "skipped" if "skipped" in tags else "passed")
        outcomes[(case.get("classname", ""), case.get("name", ""))] = outcome
    return outcomes


def is_gpu_case(item) -> bool:
    """Whether the collected test `item` exercises a GPU (the rules of the module docstring)."""
    path = str(getattr(item, "path", None) or item.fspath)
    name = os.path.basename(path)
    function = getattr(item, "originalname", None) or item.name
    if name in LEFT_OUT_FILES or function in LEFT_OUT_FUNCTIONS:
        return False
    if GPU_FILE.match(name) or item.get_closest_marker("gpu") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        reason = mark.kwargs.get("reason") or (mark.args[1] if len(mark.args) > 1 else "")
        if isinstance(reason, str) and GPU_REASON.search(reason):
            return True
    params = item.name[len(function):]
    return bool(GPU_WORD.search(params) or GPU_WORD.search(function))


def pytest_collection_modifyitems(config, items):
    gpu_only, previous = config.getoption("--gpu-only"), config.getoption("--not-passed-in")
    if not gpu_only and not previous:
        return
    passed = set()
    if previous:
        passed = {key for key, outcome in junit_outcomes(previous).items() if outcome == "passed"}
    keep = [(not gpu_only or is_gpu_case(item)) and junit_key(item.nodeid) not in passed for item in items]
    kept = [item for item, k in zip(items, keep) if k]
    dropped = [item for item, k in zip(items, keep) if not k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    # One line the session's summary quotes (the controller of an xdist run prints its own count).
    what = " and ".join(w for w, on in (("gpu-only", gpu_only), (f"not passed in {previous}", previous)) if on)
    print(f"\n{what}: {len(kept)} of {len(kept) + len(dropped)} test cases kept", flush=True)


# ----------------------------------------------------------------------------- command line (no pytest needed)


def summary_line(path: str) -> str:
    """'N passed, N failed, N errors, N skipped' of a junit.xml."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in junit_outcomes(path).values():
        counts[outcome] += 1
    return (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
            f"{counts['skipped']} skipped")


def merge(out: str, paths: list) -> None:
    """Write one junit.xml holding the test suites of `paths` (missing or unreadable files are noted)."""
    root = ET.Element("testsuites")
    for path in paths:
        try:
            tree = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as error:
            root.append(ET.Comment(f" {path}: {error} "))
            continue
        root.extend(tree.iter("testsuite") if tree.tag == "testsuites" else [tree])
    ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)


def split(groups: int, files: list) -> list:
    """`files` in `groups` lists of about equal weight (heaviest first into the lightest group).
    A file's size stands in for its running time; a file that is not a CUDA or Triton test file
    counts a tenth of it (only its few GPU cases run under --gpu-only)."""
    def weight(path):
        size = os.path.getsize(path)
        return size if GPU_FILE.match(os.path.basename(path)) else size / 10

    bins = [[0.0, []] for _ in range(max(1, groups))]
    for path in sorted(files, key=lambda p: (-weight(p), p)):
        lightest = min(bins, key=lambda b: b[0])
        lightest[0] += weight(path)
        lightest[1].append(path)
    return [sorted(b[1]) for b in bins if b[1]]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summary"] and len(argv) == 2:
        print(summary_line(argv[1]))
    elif argv[:1] == ["merge"] and len(argv) >= 2:
        merge(argv[1], argv[2:])
    elif argv[:1] == ["split"] and len(argv) >= 2:
        for group in split(int(argv[1]), argv[2:]):
            print(" ".join(group))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
