"""`specdec bench vllm`: vLLM plain, vLLM's own n-gram speculation and vLLM with our proposer
(`specdec_kernels.integrations.vllm.SpecdecProposer`), beside our own `generate`, on the dev
workloads at batch 1 and with several concurrent requests.

vLLM lives in its own virtual environment (`tools/vllm_env.sh`; found at $SPECDEC_VLLM_VENV,
default ~/.cache/specdec_kernels/vllm-venv). This module runs in the main environment: it builds
the prompts (token ids, with our tokenizer), times our `generate` in-process, and runs each vLLM
method in one worker process of the venv's Python (`python -m specdec_kernels.benchmarks.vllm
--worker job.json out.json`: one engine per method, every run of that method in it; the engine
runs in the worker's own process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so our proposer's counters
can be read). The worker half imports vLLM; the rest of the package never does.

Throughput: generated tokens / wall seconds of the whole `LLM.generate` call (all requests
submitted at once: `concurrency` requests in flight). Latency: per request, seconds from
submission to its last token (vLLM's RequestOutput.metrics where present, else the call's time).
Greedy identity: every method's tokens are compared with vLLM plain's (and ours with HF's in the
e2e benchmark); a mismatch is reported in the row ("identical": false), never hidden.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

DEFAULT_VENV = "~/.cache/specdec_kernels/vllm-venv"
PROPOSER = "specdec_kernels.integrations.vllm.SpecdecProposer"
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def venv_python() -> Optional[Path]:
    """The vLLM venv's python ($SPECDEC_VLLM_VENV or the default), None when absent."""
    venv = Path(os.path.expanduser(os.environ.get("SPECDEC_VLLM_VENV", DEFAULT_VENV)))
    python = venv / "bin" / "python"
    return python if python.is_file() else None


def method_config(method: str, k: Optional[int] = None) -> Optional[dict]:
    """vLLM's speculative_config for a method name: "plain", "ngram" (vLLM's own), "ours"."""
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(k or 5), "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    if method == "ours":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(k or 10)}
    raise ValueError(f"method: expected plain, ngram or ours, got {method!r}")


# ----------------------------------------------------------------------------- worker (venv)


def _engine(job: dict):
    from vllm import LLM

    engine = job.get("engine", {})
    kwargs = dict(model=job["model"], dtype=engine.get("dtype", "float32"), enforce_eager=True,
                  max_model_len=int(engine.get("max_model_len", 4096)),
                  max_num_seqs=int(engine.get("max_num_seqs", 32)), seed=0,
                  kv_cache_memory_bytes=int(engine.get("kv_cache_bytes", 1 << 30)),
                  disable_log_stats=False, enable_prefix_caching=bool(engine.get("prefix_caching", False)),
                  speculative_config=method_config(job["method"], job.get("k")))
    if "max_num_batched_tokens" in engine:
        kwargs["max_num_batched_tokens"] = int(engine["max_num_batched_tokens"])
    if job.get("specdec"):
        kwargs["additional_config"] = {"specdec": job["specdec"]}
    return LLM(**kwargs)


def _spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters (drafts, draft tokens, accepted tokens)."""
    out = {}
    try:
        for metric in llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
                out[metric.name.split(":", 1)[1]] = out.get(metric.name.split(":", 1)[1], 0) + metric.value
    except Exception as error:  # metrics are a report, never a failure
        out["error"] = repr(error)
    return out


def _proposer_stats() -> Optional[dict]:
    from specdec_kernels.integrations.vllm import proposers

    live = proposers()
    return live[0].stats() if live else None


def run_worker(job: dict) -> dict:
    """Run `job["runs"]` on one engine; each run: prompts (token ids), max_tokens, concurrency,
    repeats. Returns per run the tokens of every request and per repeat the timings."""
    from vllm import SamplingParams

    start = time.perf_counter()
    llm = _engine(job)
    result = {"method": job["method"], "k": job.get("k"), "init_seconds": time.perf_counter() - start, "runs": []}
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": job["runs"][0]["prompts"][0]}], warm, use_tqdm=False)  # first-call costs
    for run in job["runs"]:
        params = SamplingParams(temperature=0.0, max_tokens=int(run["max_tokens"]), ignore_eos=bool(run.get("ignore_eos")))
        prompts, concurrency = run["prompts"], int(run["concurrency"])
        repeats = []
        tokens = None
        for _ in range(int(run.get("repeats", 1))):
            before = _proposer_stats()
            metrics_before = _spec_metrics(llm)
            outs, latencies = [], []
            t0 = time.perf_counter()
            for begin in range(0, len(prompts), concurrency):
                group = [{"prompt_token_ids": p} for p in prompts[begin: begin + concurrency]]
                g0 = time.perf_counter()
                got = llm.generate(group, params, use_tqdm=False)
                g1 = time.perf_counter()
                for o in got:
                    outs.append(list(o.outputs[0].token_ids))
                    latencies.append(g1 - g0)  # the group finishes together from the caller's view
                    m = getattr(o, "metrics", None)
                    if m is not None and getattr(m, "first_token_latency", None) is not None:
                        pass
            seconds = time.perf_counter() - t0
            after = _proposer_stats()
            metrics_after = _spec_metrics(llm)
            spec = {k: metrics_after.get(k, 0) - metrics_before.get(k, 0) for k in metrics_after
                    if isinstance(metrics_after.get(k), (int, float))}
            proposer = None
            if after is not None:
                proposer = {k: (after[k] - (before or {}).get(k, 0)) for k in
                            ("steps", "decode_rows", "drafted", "verified", "accepted", "propose_seconds",
                             "step_seconds", "timed_steps") if isinstance(after.get(k), (int, float))}
                proposer["token_cost_ratio"] = after.get("token_cost_ratio")
            repeats.append({"seconds": seconds, "new_tokens": sum(len(o) for o in outs),
                            "latencies": latencies, "spec_metrics": spec, "proposer": proposer})
            if tokens is None:
                tokens = outs
            elif tokens != outs:
                repeats[-1]["differs_from_first_repeat"] = True
        result["runs"].append({"name": run.get("name"), "concurrency": concurrency, "tokens": tokens,
                               "repeats": repeats})
    result["proposer_stats"] = _proposer_stats()
    return result


def call_worker(job: dict, *, timeout: float = 3600, python: Optional[Path] = None) -> dict:
    """Run `job` in the vLLM venv (RuntimeError with the worker's output tail when it fails)."""
    python = python or venv_python()
    if python is None:
        raise RuntimeError("no vLLM venv: run tools/vllm_env.sh (or set SPECDEC_VLLM_VENV)")
    with tempfile.TemporaryDirectory(prefix="specdec-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ, **WORKER_ENV)
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(python), "-m", "specdec_kernels.benchmarks.vllm", "--worker", str(job_path),
                               str(out_path)], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=tmp)
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"vLLM worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def _worker_main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    result = run_worker(job)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2], sys.argv[3]))
