"""generate on a tensor-parallel target (transformers tp_plan="auto", two CPU processes with
gloo under torchrun) gives the same output as one process, on every rank, and every rank
verifies the same trees (the adaptive planner must not plan from a rank's own timings: ranks
whose forwards differ in shape break the collectives)."""

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it for tp_plan

import specdec_kernels as sk  # noqa: E402
from test_generate import left_pad, repetitive_prompts  # noqa: E402
from tp_worker import CASES  # noqa: E402


def test_tensor_parallel_matches_one_process(tmp_path):
    torch.manual_seed(0)
    # 8 query / 4 KV heads: each of the 2 ranks holds 2 KV heads, so the cache must be sized
    # from what the sharded model writes, not from the config.
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "model")
    ids, mask = left_pad(repetitive_prompts(2))
    torch.save({"input_ids": ids, "attention_mask": mask}, tmp_path / "inputs.pt")
    worker = os.path.join(os.path.dirname(__file__), "tp_worker.py")
    # A clean environment: settings earlier tests left in os.environ must not reach the workers.
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p), HF_HUB_OFFLINE="1")
    # torchrun as a module of this interpreter: a `torchrun` on PATH may be another Python's.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker,
                          str(tmp_path / "model"), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[:3000] + "\n...\n" + run.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    single = {name: sk.generate(model, ids, attention_mask=mask, **kwargs()).sequences for name, kwargs in CASES.items()}
    for name in CASES:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name}: ranks disagree"
        assert torch.equal(ranks[0][name + "_widths"], ranks[1][name + "_widths"]), f"{name}: ranks planned apart"
        assert torch.equal(ranks[0][name], single[name]), f"{name}: tensor parallel differs from one process"
    assert torch.equal(ranks[0]["greedy_ngram_tree"], ranks[0]["hf_greedy"])
