"""The benchmark suite (`specdec bench e2e` / `specdec bench kernels`) on tiny configurations:
the code runs, the JSON has the results schema (`benchmarks.common.metadata` and rows of
config / ours_us / floor_us / peers_us), the plots are written. No timing is
checked (timing belongs in benchmarks, not tests)."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from specdec_kernels import cli, workloads  # noqa: E402
from specdec_kernels.benchmarks import common, e2e, kernels  # noqa: E402
from conftest import INTERPRETER_DEFECT, WordTokenizer  # noqa: E402

VOCAB = 512
HEADER_KEYS = {"benchmark", "device", "backend", "torch", "triton", "transformers", "commit", "date", "rows"}
needs_prompts = pytest.mark.skipif(workloads.data_dir() is None, reason="the n-gram benchmark reads the shared prompt "
                                   "files (shared/data/prompts beside the repository, or $SPECDEC_DATA)")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def short_requests():
    """One request per workload: the real prompts (cut to ~80 words to keep the test fast) when
    the shared files are present, else small ones of our own."""
    if workloads.data_dir() is not None:
        out = {}
        for name in workloads.WORKLOADS:
            r = workloads.load_workload(name, limit=2)
            out[name] = [workloads.Request(name, x.id, " ".join(x.text.split()[:80]), x.chat) for x in r]
        return out
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 3
    return {name: [workloads.Request(name, f"{name}/{i}", text + str(i), chat=name != "code_completion")
                   for i in range(2)] for name in workloads.WORKLOADS}


def check_rows(rows):
    for r in rows:
        c = r["config"]
        assert set(c) >= {"workload", "batch", "temperature", "method"}
        if c["method"] in e2e.BATCH1_ONLY and c["batch"] > 1:
            assert "skipped" in r
            continue
        assert r["tokens_per_s"] > 0 and r["new_tokens"] > 0 and r["speedup_vs_hf"] > 0
        if c["method"].startswith("ours"):
            assert r["tokens_per_step"] >= 1.0 and r["steps"] >= 1
            assert all(0.0 <= a <= 1.0 for a in r["acceptance_by_depth"])
        if c["temperature"] == 0 and c["method"] != "hf":
            # Greedy outputs are checked against HF greedy generate, row by row, in every pass.
            assert r["greedy_compared_rows"] == c["batch"] * len(r.get("runs") or [None])
            if c["method"].startswith("ours"):
                assert r["greedy_identical"], r["mismatches"]


@pytest.fixture(scope="module")
def tiny_models():
    return tiny_model(0), tiny_model(1)


def train_tiny_head(model, tmp_path, monkeypatch):
    """A user head for the tiny target, found by its identity under <cache>/heads (the cache is
    tmp_path), so the learned-head methods (ours_eagle, ours_default, ...) run too."""
    from specdec_kernels.heads import train_draft_head

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (10,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    train_draft_head(model, prompts, kind="eagle", out_dir=tmp_path / "heads" / "tiny", steps=2, max_new_tokens=4,
                     batch_tokens=128, eval_fraction=0.0, draft_vocab_size=vocab, progress=False)
    train_draft_head(model, prompts, kind="mtp", out_dir=tmp_path / "heads" / "tiny_mtp", steps=2, max_new_tokens=4,
                     batch_tokens=128, eval_fraction=0.0, draft_vocab_size=vocab, progress=False)  # ours_mtp, ours_default_mtp


def test_e2e_every_method_batch_and_sampling(tiny_models, tmp_path, monkeypatch):
    model, draft = tiny_models
    train_tiny_head(model, tmp_path, monkeypatch)
    requests = {"code_edit": short_requests()["code_edit"]}
    rows = e2e.run(model, WordTokenizer(VOCAB), requests, draft=draft, methods=e2e.METHODS, batch_sizes=(1, 2),
                   temperatures=(0.0, 0.7), max_new_tokens=4, prompts_per_workload=1, profile_kernels=False,
                   progress=False)
    assert len(rows) == 2 * 2 * len(e2e.METHODS)
    check_rows(rows)


def test_e2e_fixed_head_tree_shapes(tiny_models, tmp_path, monkeypatch):
    """The fixed-tree head methods take a tree shape after the name (a sweep in one run): each
    row verifies that many nodes per step, keeps the greedy output, and bad shapes are refused."""
    model, _ = tiny_models
    train_tiny_head(model, tmp_path, monkeypatch)
    requests = {"code_edit": short_requests()["code_edit"]}
    methods = ("hf", "ours_eagle_fixed", "ours_eagle_fixed:6/3/2", "ours_default_fixed:6/3/2")
    rows = e2e.run(model, WordTokenizer(VOCAB), requests, methods=methods, batch_sizes=(1,), temperatures=(0.0,),
                   max_new_tokens=8, prompts_per_workload=1, profile_kernels=False, progress=False)
    check_rows(rows)
    by_method = {r["config"]["method"]: r for r in rows}
    assert set(by_method) == set(methods)
    assert by_method["ours_eagle_fixed"]["nodes_per_step"] == 24  # HEAD_FIXED_TREE
    assert by_method["ours_eagle_fixed:6/3/2"]["nodes_per_step"] == 6
    assert by_method["ours_default_fixed:6/3/2"]["nodes_per_step"] >= 6  # the head's 6 plus n-gram drafts
    for method in methods[1:]:
        assert by_method[method]["greedy_identical"]

    assert e2e.split_method("ours_eagle") == ("ours_eagle", None)
    assert e2e.split_method("ours_default_fixed:64/8/8") == (
        "ours_default_fixed", dict(max_nodes=64, depth=8, top_k=8, min_score=0.0))
    for bad in ("ours_eagle:64/8/8", "ours_eagle_fixed:64/8", "ours_eagle_fixed:a/8/8", "ours_eagle_fixed:0/8/8",
                "ours_magic"):
        with pytest.raises(ValueError):
            e2e.split_method(bad)
    with pytest.raises(SystemExit, match="tree shape"):
        cli.main(["bench", "e2e", "--methods", "hf,ours_eagle_fixed:64/x/8"])


def test_e2e_head_methods_without_a_head(tiny_models, tmp_path, monkeypatch):
    """A target without a trained head: the head-only methods are skipped with the reason,
    ours_default runs (n-gram alone)."""
    model, _ = tiny_models
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))  # no user heads here
    requests = {"code_edit": short_requests()["code_edit"]}
    methods = ("hf", "ours_eagle", "ours_eagle_fixed", "ours_default_fixed", "ours_default")
    rows = e2e.run(model, WordTokenizer(VOCAB), requests, methods=methods, batch_sizes=(1,), temperatures=(0.0,),
                   max_new_tokens=4, prompts_per_workload=1, profile_kernels=False, progress=False)
    by_method = {r["config"]["method"]: r for r in rows}
    for method in ("ours_eagle", "ours_eagle_fixed", "ours_default_fixed"):
        assert by_method[method]["skipped"] == "no trained EAGLE head for this target"
    assert "skipped" not in by_method["ours_default"] and by_method["ours_default"]["greedy_identical"]
    fixed = {"ours_eagle_fixed", "ours_default_fixed"}
    assert not fixed & set(e2e.default_methods("cpu")) and fixed <= set(e2e.default_methods("cuda"))


def test_e2e_repeats_report_medians_of_paired_ratios(tiny_models):
    model, _ = tiny_models
    requests = {"code_edit": short_requests()["code_edit"]}
    rows = e2e.run(model, WordTokenizer(VOCAB), requests, methods=("hf", "ours_ngram", "ours_ngram_fixed"), batch_sizes=(1,),
                   temperatures=(0.0,), max_new_tokens=4, prompts_per_workload=1, profile_kernels=False,
                   progress=False, repeats=3)
    assert len(rows) == 3
    check_rows(rows)
    for r in rows:
        runs = r["runs"]
        assert len(runs) == 3
        assert r["tokens_per_s"] == sorted(x["tokens_per_s"] for x in runs)[1]
        assert r["speedup_vs_hf"] == sorted(x["speedup_vs_hf"] for x in runs)[1]
        if r["config"]["method"] != "hf":
            assert 0.0 <= r["plan_share"] < 1.0
            steps = sum(v[0] for v in r["size_vs_acceptance"].values())
            assert steps == r["steps"]  # the first pass's record
            assert all(0.0 <= v[1] <= int(k) for k, v in r["size_vs_acceptance"].items())
    with pytest.raises(ValueError, match="repeats"):
        e2e.run(model, WordTokenizer(VOCAB), requests, methods=("hf",), batch_sizes=(1,), temperatures=(0.0,),
                max_new_tokens=2, prompts_per_workload=1, progress=False, repeats=0)


def test_e2e_kernel_share(tiny_models):
    model, _ = tiny_models
    (input_ids, mask, _), = e2e.make_batches(short_requests()["code_edit"][:1], WordTokenizer(VOCAB), 1, "cpu")
    share = e2e.kernel_share("ours_ngram", model, None, input_ids, mask, max_new_tokens=4, temperature=0.0, eos=None,
                             pad=0, seed=0)
    assert share["basis"] == "cpu time" and "verify" in share and 0.0 < share["total"] <= 1.5


def test_e2e_four_workloads_write_json_and_plots(tiny_models, tmp_path, capsys):
    model, _ = tiny_models
    settings = dict(max_new_tokens=4, prompts_per_workload=1)
    partial = []

    def on_rows(rows, planned):  # what run_args does after every run: the JSON so far, nothing else
        paths = e2e.write_results(rows, tmp_path, device="cpu", model_label="tiny random llama", settings=settings,
                                  name="tiny", planned=planned, complete=False)
        assert set(paths) == {"json"}
        partial.append(json.loads(paths["json"].read_text()))

    rows = e2e.run(model, WordTokenizer(VOCAB), short_requests(), methods=("hf", "ours_ngram"), batch_sizes=(1,),
                   temperatures=(0.0,), max_new_tokens=4, prompts_per_workload=1, progress=False, on_rows=on_rows)
    assert [r["config"]["workload"] for r in rows] == [w for w in workloads.WORKLOADS for _ in range(2)]
    check_rows(rows)
    # A line per finished run although progress=False (what a log of a stopped run shows).
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\[\d+/8\] ", line)]
    assert len(lines) == 8 and lines[-1].lstrip().startswith("[8/8] ")
    assert [len(r["rows"]) for r in partial] == list(range(1, 9))
    for r in partial:
        assert HEADER_KEYS <= set(r) and r["complete"] is False and r["rows_planned"] == 8
    assert partial[-1]["rows"][1]["speedup_vs_hf"] > 0  # against the hf row written before it
    assert not (tmp_path / "e2e_tiny.md").exists()  # the Markdown and plots come with the final write
    paths = e2e.write_results(rows, tmp_path, device="cpu", model_label="tiny random llama", settings=settings,
                              name="tiny")
    result = json.loads(paths["json"].read_text())
    assert HEADER_KEYS <= set(result) and result["benchmark"] == "e2e"
    assert result["complete"] is True and result["rows_planned"] == len(result["rows"]) == 8
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]) and result["torch"] == torch.__version__
    for kind in ("speedup_png", "acceptance_png", "planner_png"):
        assert paths[kind].stat().st_size > 1000 and paths[kind].read_bytes()[:4] == b"\x89PNG"
    assert "| code_edit |" in paths["md"].read_text()


def test_random_llama3_fails_clearly_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cli.main(["bench", "e2e", "--model", "llama3-8b-random"])


def test_random_llama3_has_llama3_8b_shapes():
    """The stand-in matches figures published for Llama-3-8B, not this code's own constants: Meta's
    parameter count, 8,030,261,248, and 128 KiB of bf16 KV cache per token; a forward pass (on
    the meta device) checks that the shapes fit together and the vocabulary is 128256."""
    model = e2e.random_llama3_8b(device="meta")
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    assert 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2 == 128 * 1024  # K and V, 2 bytes each
    logits = model(torch.zeros(1, 3, dtype=torch.long, device="meta")).logits
    assert logits.shape == (1, 3, 128256)
    assert e2e.random_llama3_8b(layers=2, device="meta").config.num_hidden_layers == 2


def test_random_default_model_has_the_default_models_shapes():
    """The GPU overhead stand-in has SmolLM2-135M's published size (134,515,008 parameters,
    embeddings tied) and, where the default model is installed, its config's shapes."""
    model = e2e.random_default_model(device="meta")
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model(torch.zeros(1, 3, dtype=torch.long, device="meta")).logits.shape == (1, 3, 49152)
    assert e2e.random_default_model(layers=2, device="meta").config.num_hidden_layers == 2
    from specdec_kernels import models

    try:
        folder = models.default_model_dir(verbose=False)
    except (ImportError, OSError):
        return
    from transformers import AutoConfig

    want, got = AutoConfig.from_pretrained(folder).to_dict(), model.config.to_dict()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings", "model_type")
    assert {k: got[k] for k in keys if k in want} == {k: want[k] for k in keys if k in want}
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"], rel=1e-6)  # (the GGUF holds it as a float32)


@needs_prompts
def test_bench_kernels_smoke_writes_json_and_plot(tmp_path, capsys):
    status = cli.main(["bench", "kernels", "--smoke", "--only", "ngram", "--out-dir", str(tmp_path)])
    assert status == 0
    result = json.loads((tmp_path / "ngram_cpu_smoke.json").read_text())
    assert HEADER_KEYS <= set(result) and result["benchmark"] == "ngram"
    assert result["complete"] is True and result["rows_planned"] == 2
    assert [(r["config"]["B"], r["config"]["L"], r["config"]["policy"]) for r in result["rows"]] == [
        (2, 512, "earliest"), (2, 512, "latest")]
    for row in result["rows"]:
        assert row["ours_us"] > 0 and row["floor_us"] > 0 and row["bytes"] > 0 and isinstance(row["peers_us"], dict)
        assert "unfold" in row["checked"] and row["peers_us"]["unfold"] > 0
    assert (tmp_path / "ngram_cpu_smoke.png").read_bytes()[:4] == b"\x89PNG"


@needs_prompts
def test_ngram_bench_keeps_the_rows_of_a_stopped_run(tmp_path, monkeypatch):
    """The JSON is rewritten after every config: a run that dies in its second config (as one
    killed at a time limit would) leaves the first row, marked incomplete."""
    from specdec_kernels.benchmarks import ngram

    real = ngram.bench_config
    calls = []

    def second_one_dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a signal at the limit looks like to the sweep
        return real(*args, **kwargs)

    monkeypatch.setattr(ngram, "bench_config", second_one_dies)
    out = tmp_path / "ngram.json"
    with pytest.raises(KeyboardInterrupt):
        ngram.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert HEADER_KEYS <= set(result) and result["benchmark"] == "ngram"
    assert result["complete"] is False and result["rows_planned"] == 2 and len(result["rows"]) == 1
    assert result["rows"][0]["config"]["policy"] == "earliest" and result["rows"][0]["ours_us"] > 0
    assert not out.with_suffix(".png").exists() and not list(tmp_path.glob("*.tmp"))


def test_write_rows_replaces_the_file_whole(tmp_path):
    path = tmp_path / "r.json"
    header = common.metadata("verify", "cpu", "triton")
    common.write_rows(header, [{"config": {"B": 1}}], path, planned=3, complete=False)
    first = json.loads(path.read_text())
    assert first["complete"] is False and first["rows_planned"] == 3 and len(first["rows"]) == 1
    common.write_rows(header, [{"config": {"B": 1}}, {"config": {"B": 2}}], path, planned=2, complete=True)
    second = json.loads(path.read_text())
    assert second["complete"] is True and [r["config"]["B"] for r in second["rows"]] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_commit_from_the_environment_first(monkeypatch):
    """The GPU machine's copy of the checkout has no .git: the session script passes the commit."""
    monkeypatch.setenv("SPECDEC_COMMIT", "abc1234+dirty")
    assert common.git_commit() == "abc1234+dirty"
    assert common.metadata("ngram", "cpu", "cpu")["commit"] == "abc1234+dirty"
    monkeypatch.delenv("SPECDEC_COMMIT")
    from_git = common.git_commit()
    assert from_git == "unknown" or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", from_git)
    monkeypatch.setenv("SPECDEC_COMMIT", " ")  # blank counts as unset: git decides
    assert common.git_commit() == from_git


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_unfold_peer_matches_the_reference(dtype, gen):
    """The n-gram benchmark's torch `unfold` peer follows ngram_propose's rule exactly: random
    histories over small vocabularies (many matches, ties between positions), ragged lengths
    down to 0 and 1, several (min_n, max_n), both policies."""
    import specdec_kernels as sk
    from specdec_kernels.benchmarks.ngram import unfold_propose

    for _ in range(40):
        batch, width = int(torch.randint(1, 7, (1,), generator=gen)), int(torch.randint(1, 48, (1,), generator=gen))
        vocab = int(torch.randint(2, 8, (1,), generator=gen))
        tokens = torch.randint(0, vocab, (batch, width), generator=gen, dtype=dtype)
        lengths = torch.randint(0, width + 1, (batch,), generator=gen)
        lengths[0] = width
        tokens[torch.arange(width)[None, :] >= lengths[:, None]] = -1  # padding past each row's length
        for min_n, max_n in ((1, 1), (1, 4), (2, 3), (3, 6), (2, 2)):
            for num_tokens in (1, 5):
                for policy in ("earliest", "latest"):
                    kw = dict(min_n=min_n, max_n=max_n, num_tokens=num_tokens, policy=policy)
                    want = sk.ngram_propose(tokens, lengths, **kw, backend="reference")
                    got = unfold_propose(tokens, lengths, min_n, max_n, num_tokens, policy)
                    assert got[0].dtype == want[0].dtype and got[1].dtype == torch.int32
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tokens, lengths, kw)


def test_kernels_runner_order():
    """On a GPU the GPU benchmarks come first (a stopped run has measured them); on a CPU n-gram."""
    names = list(kernels.BENCHMARKS)
    assert kernels.run_order(names, "cuda") == ["verify", "tree_attention", "ngram"]
    assert kernels.run_order(names, "cpu") == ["ngram", "verify", "tree_attention"]
    assert kernels.run_order(["tree_attention", "ngram", "verify"], "cuda") == ["tree_attention", "verify", "ngram"]


def test_kernels_runner_finds_or_explains_each_benchmark():
    for name in kernels.BENCHMARKS:
        module = kernels.load_benchmark(name)
        assert callable(module.main) and module.__name__ == f"specdec_kernels.benchmarks.{name}"
    with pytest.raises(ValueError, match="name must be one of"):
        kernels.load_benchmark("nope")
    if not torch.cuda.is_available():
        assert kernels.cpu_skip_reason("ngram") is None
        assert kernels.cpu_skip_reason("verify") and kernels.cpu_skip_reason("tree_attention")
    assert common.slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


@pytest.mark.parametrize("mode", [dict(), dict(full=True), dict(smoke=True), dict(goal=True)],
                         ids=["quick", "full", "smoke", "goal"])
def test_gpu_benchmarks_accept_the_runners_command_line(mode, tmp_path):
    # verify and tree_attention only run on a GPU: parse here what the runner passes them.
    from specdec_kernels.benchmarks import tree_attention, verify

    args = dict(full=False, smoke=False, goal=False, out_dir=tmp_path, device="cpu") | mode
    suffix = "_smoke" if args["smoke"] else "_goal" if args["goal"] else ""
    for module in (verify, tree_attention):
        name = module.__name__.rsplit(".", 1)[1]
        parsed = module.parse_args(kernels.argv_for(name, **args))
        assert (parsed.full, parsed.smoke, parsed.goal) == (args["full"], args["smoke"], args["goal"])
        assert parsed.out == str(tmp_path / f"{name}_cpu{suffix}.json")
        if module is verify:  # the runner's file name is the one verify picks itself for --out-dir
            flags = [f"--{m}" for m in ("full", "smoke", "goal") if args[m]]
            by_dir = verify.parse_args(flags + ["--out-dir", str(tmp_path)])
            assert verify.output_path(by_dir, torch.device("cpu")) == parsed.out


def test_goal_mode_runs_the_goal_configurations_alone():
    """`bench kernels --goal` (the device window's bench stage) times exactly the configurations
    issue 37 states its goals at, nothing of the sweep."""
    import argparse

    from specdec_kernels.benchmarks import tree_attention, verify

    goal = verify.configs(verify.parse_args(["--goal"]))
    assert sorted((c["B"], c["kind"], c["size"], c["V"], c["mode"]) for c in goal) == sorted(
        (64, kind, size, 128256, mode) for kind, size in (("chain", 4), ("tree", 64)) for mode in ("greedy", "sampled"))
    old = tree_attention.ARGS
    try:
        tree_attention.ARGS = tree_attention.parse_args(["--goal"])
        assert tree_attention.configs() == [dict(shape="llama3-8b", heads=(32, 8, 128), B=8, T=64, prefix=8192)]
    finally:
        tree_attention.ARGS = old
    from specdec_kernels.benchmarks import ngram

    assert ngram.sweep_configs(argparse.Namespace(full=False, smoke=False, goal=True)) == [
        (256, 32768, "text", "earliest"), (256, 32768, "random", "earliest")]
    parser = kernels.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--goal"]).goal
    with pytest.raises(SystemExit):
        parser.parse_args(["--goal", "--full"])


def test_verify_output_path():
    from specdec_kernels.benchmarks import verify

    cpu = torch.device("cpu")
    assert verify.output_path(verify.parse_args(["--out", "/x/v.json"]), cpu) == "/x/v.json"
    assert verify.output_path(verify.parse_args(["--out-dir", "/x"]), cpu) == "/x/verify_cpu.json"
    assert verify.output_path(verify.parse_args(["--smoke", "--out-dir", "/x"]), cpu) == "/x/verify_cpu_smoke.json"
    assert verify.output_path(verify.parse_args(["--smoke"]), cpu) == "/tmp/bench_verify_smoke.json"
    assert verify.output_path(verify.parse_args([]), cpu) == str(common.results_dir() / "verify_cpu.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU --smoke path (the GPU runs the real sweep)")
def test_verify_smoke_writes_json_and_plot(monkeypatch, tmp_path):
    import sys

    from specdec_kernels.ops import _extension
    from specdec_kernels.benchmarks import verify

    if not _extension.HAS_TRITON:
        pytest.skip("triton not installed")
    if INTERPRETER_DEFECT is not None:
        pytest.skip(INTERPRETER_DEFECT)
    kernel = sys.modules.get("specdec_kernels.ops.triton.verify")
    if kernel is not None and not kernel.interpreted():
        pytest.skip("the Triton verify kernels were imported for the compiler earlier in this process")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main() sets it; restored after the test
    assert verify.main(["--smoke", "--out-dir", str(tmp_path), "--reps", "1"]) == 0
    result = json.loads((tmp_path / "verify_cpu_smoke.json").read_text())
    assert HEADER_KEYS <= set(result) and result["benchmark"] == "verify" and result["mode"] == "smoke"
    assert result["complete"] is True and result["rows_planned"] == 2
    assert [r["config"]["tree"] for r in result["rows"]] == ["chain3", "tree6"]
    for row in result["rows"]:
        assert "errors" not in row and row["ours_backend"] == "triton" and row["ours_us"] > 0 and row["bytes"] > 0
    assert [set(r["peers_us"]) for r in result["rows"]] == [{"torch_native"}, {"reference"}]
    assert (tmp_path / "verify_cpu_smoke.png").read_bytes()[:4] == b"\x89PNG"
