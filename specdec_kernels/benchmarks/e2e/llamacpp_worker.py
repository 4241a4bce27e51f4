"""`specdec bench e2e`'s llama.cpp worker: runs in the llama.cpp venv (tools/llamacpp_env.sh), by
file path, never as part of the package (that venv has llama-cpp-python, not specdec_kernels).

    <llamacpp-venv>/bin/python -I llamacpp_worker.py job.json

The job (JSON): {"model": GGUF path, "method": "plain" | "lookup", "threads": n, "n_ctx": n,
"lookup": {"max_ngram_size": .., "num_pred_tokens": ..}, "eos": [token ids], "warmup_prompt": [ids]}.
It loads the model once, generates a few tokens untimed (first-call costs), prints a SENTINEL
line, then answers one request per stdin line (the protocol of `benchmarks.vllm.Worker`):
{"prompts": [[ids], ...], "max_tokens": n, "temperature": t, "seed": s} -> {"tokens": [[ids], ...]
(each up to and including the first eos), "seconds": summed wall time of the prompts, "seconds_each",
"new_tokens"}. "quit" ends it.

Every prompt starts from an empty KV cache (`Llama.reset()`): llama-cpp-python would otherwise reuse
the previous prompt's matching prefix (the chat template's system turn), a prefix cache HF and our
loop do not have. Prompts go in as token ids (our tokenizer's, chat template applied), so every
engine sees the same tokens. Greedy: temp=0 (llama.cpp's greedy sampler); sampled: temp=t with top-k,
top-p and min-p off, as the HF rows sample. Prompt lookup: llama-cpp-python's LlamaPromptLookupDecoding
as the Llama's draft model, with logits_all=True (0.3.36 crashes past 512 positions without it).
"""

import json
import sys
import time
from pathlib import Path

# Run by path, Python puts this folder first on sys.path; its modules (models.py, report.py, ...)
# belong to the package, not to this venv: keep them from shadowing anything llama_cpp imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]

SENTINEL = "@@SPECDEC@@ "  # benchmarks.vllm.SENTINEL (this file cannot import it)


def load(job):
    """The Llama of a job (plain, or with prompt lookup decoding)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None
    if job["method"] == "lookup":
        draft = LlamaPromptLookupDecoding(**job.get("lookup", {}))
    elif job["method"] != "plain":
        raise ValueError(f"method: expected plain or lookup, got {job['method']!r}")
    threads = int(job["threads"])
    return Llama(model_path=job["model"], n_ctx=int(job["n_ctx"]), n_threads=threads, n_threads_batch=threads,
                 n_batch=512, logits_all=draft is not None, draft_model=draft, seed=0, verbose=False)


def generate_one(llm, prompt, max_tokens, eos, temperature=0.0, seed=None):
    """(tokens up to and including the first eos, at most max_tokens; seconds) of one prompt."""
    llm.reset()  # no prefix reuse from the previous prompt (see the module docstring)
    if seed is not None:
        llm.set_seed(int(seed))
    sampling = dict(temp=0.0) if temperature == 0 else dict(temp=float(temperature), top_k=0, top_p=1.0, min_p=0.0)
    out = []
    start = time.perf_counter()
    for token in llm.generate(prompt, repeat_penalty=1.0, **sampling):
        out.append(int(token))
        if token in eos or len(out) >= max_tokens:
            break
    return out, time.perf_counter() - start


def answer(llm, request, eos):
    """One request: every prompt in turn."""
    tokens, seconds = [], []
    for i, prompt in enumerate(request["prompts"]):
        seed = request.get("seed")
        out, s = generate_one(llm, prompt, int(request["max_tokens"]), eos, float(request.get("temperature", 0.0)),
                              None if seed is None else int(seed) + i)
        tokens.append(out)
        seconds.append(s)
    return {"tokens": tokens, "seconds": sum(seconds), "seconds_each": seconds,
            "new_tokens": sum(len(t) for t in tokens)}


def serve(job_path):
    """Load the job's model, warm it up, then answer requests from stdin until "quit" or EOF."""
    job = json.loads(Path(job_path).read_text())
    eos = set(int(t) for t in job.get("eos") or ())
    start = time.perf_counter()
    llm = load(job)
    init = time.perf_counter() - start
    generate_one(llm, job["warmup_prompt"], 8, eos)  # untimed: first-call costs
    import llama_cpp

    print(SENTINEL + json.dumps({"ready": True, "init_seconds": init, "version": llama_cpp.__version__,
                                 "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}),
          flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        try:
            reply = answer(llm, json.loads(line), eos)
        except Exception as error:  # reported to the driver, which fails the row
            reply = {"error": repr(error)}
        print(SENTINEL + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
