"""Training data for learned heads, by self-distillation.

Two passes, both batched and both resumable from shards in a work folder:
1. responses: the target answers the training prompts itself. A copy of the target in
   `generation_dtype` (bfloat16 by default: on CPUs with bf16 matrix units a batch of 48
   rows decodes ~2x faster than fp32) answers batches of prompts of similar length (left
   padded) with this package's own decoding loop (`generate`, no drafts; 1.2-3x HF
   `generate`'s speed here, see `_write`). The text is the model's own (greedy, or sampled
   at `temperature`).
2. features: the target's features (the LM head's input) at every position of each prompt +
   response, and the log-sum-exp and argmax of its full logits there (from the target's own
   LM head), so training can turn restricted-vocabulary logits into the target's exact
   probabilities. When the features are asked for in the writer's dtype (`feature_dtype`
   equal to `generation_dtype`: the recipe's bf16), the writer records them as it writes:
   its prefill and decoding forwards compute them anyway (`features_from_writer`). Otherwise
   (another dtype, or extra layers for EAGLE-3) one teacher-forced forward over the whole
   sequences computes them afterwards.

One example: `tokens int32 [n]`, `features fp16 [n - 1, H]` (feature i predicts token i + 1),
`lse fp32 [n - 1]`, `argmax int32 [n - 1]` (both from the fp16-rounded features, the same
numbers training reads back), and with `feature_layers` (EAGLE-3 heads) `inputs bf16
[n - 1, len(feature_layers), H]`, those hidden states of the target at every position.
"""

import json
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from ..loop.drafters import Drafter
from .common import lm_head_weight

_MARK = "\u2063SPECDEC_USER\u2063"  # stands for the user turn when cutting the chat template


def render_prompts(tokenizer, prompts: Sequence) -> List[List[int]]:
    """Token ids of each prompt. A prompt is a `workloads.Request`, a dict with "prompt"
    (a user turn, rendered with the chat template when the tokenizer has one) or "text" (raw
    text to continue), a str (a user turn, as "prompt"), or token ids (a list of ints or a 1D
    tensor, used as they are)."""
    from ..workloads import Request

    out = []
    for p in prompts:
        if isinstance(p, torch.Tensor) or (isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p)):
            out.append([int(t) for t in torch.as_tensor(p).reshape(-1).tolist()])  # token ids as given
            continue
        if tokenizer is None:
            raise ValueError("prompts: text prompts need the target's tokenizer")
        if isinstance(p, Request):
            out.append(p.input_ids(tokenizer)[0].tolist())
            continue
        if isinstance(p, str):
            p = {"prompt": p}
        if not isinstance(p, dict) or not (isinstance(p.get("prompt"), str) or isinstance(p.get("text"), str)):
            raise ValueError(f"prompts: each item must be a str, a Request, or a dict with 'prompt' or 'text', got {p!r:.80}")
        if "text" in p:
            out.append(tokenizer(p["text"], add_special_tokens=True)["input_ids"])
        elif getattr(tokenizer, "chat_template", None) is not None:
            out.append(Request("prompts", "", p["prompt"], chat=True).input_ids(tokenizer)[0].tolist())
        else:
            out.append(tokenizer(p["prompt"], add_special_tokens=True)["input_ids"])
    return [ids for ids in out if ids]


def read_prompts_jsonl(path) -> list:
    """Rows of a JSON-lines prompt file: objects with "prompt" or "text" (see `render_prompts`)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    return rows


def workload_prompts(holdout: int, names=None) -> list:
    """The shared dev workloads' requests minus the first `holdout` of each (the benchmarks
    measure the first ones, so a head trained on the rest is measured on unseen requests)."""
    from ..workloads import WORKLOADS, load_workload

    requests = []
    for name in names or WORKLOADS:
        requests += load_workload(name)[holdout:]
    return requests


def _eos_ids(target, eos_token_id=None) -> List[int]:
    """eos ids: the given ones, else the target's generation config's (maybe none)."""
    eos = eos_token_id
    if eos is None:
        eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _writer(target, dtype):
    """The model that writes responses: the target itself when `dtype` is None or its own
    dtype, else a copy in `dtype` (the target is left as it is)."""
    if dtype is None or dtype == next(target.parameters()).dtype:
        return target
    import copy

    return copy.deepcopy(target).to(dtype).eval()


# Which decoding loop wrote a cache's texts (kept in the cache settings: another writer would
# continue a cache with other samples, so such a cache is refused or restarted).
WRITER = "specdec_kernels.loop.generate"


class _FeatureRecorder(Drafter):
    """A drafter that drafts nothing and keeps the writer's features: the LM head's input at
    every position its `generate` call fed (the prompt at prefill, then each emitted token
    but the last), per row of the call, in fp16 (as the collected examples store them)."""

    needs_hidden_states = True

    def __init__(self, model):
        self.model = model

    def start(self, history, lengths, capacity):
        hidden = lm_head_weight(self.model).shape[1]
        self.features = torch.zeros(history.shape[0], capacity, hidden, device=history.device, dtype=torch.float16)
        self.known = lengths.long() - 1  # after the prefill: positions 0 .. L - 2
        self.rows = list(range(history.shape[0]))  # the call's row index of each row still running
        self.done = {}

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        if accepted_nodes is None:
            self.features[:, : hidden_states.shape[1]] = hidden_states.to(torch.float16)
            return
        # No drafts: each row's tree is its root, the last emitted token, at position known.
        rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
        self.features[rows, self.known] = hidden_states[:, 0].to(torch.float16)
        self.known = self.known + 1

    def _archive(self, b):
        self.done[self.rows[b]] = self.features[b, : int(self.known[b])].cpu()

    def keep_rows(self, rows):
        kept = rows.tolist()
        for b in sorted(set(range(len(self.rows))) - set(kept)):
            self._archive(b)
        self.rows = [self.rows[b] for b in kept]
        self.features, self.known = self.features[rows], self.known[rows]

    def finish(self):
        for b in range(len(self.rows)):
            self._archive(b)
        self.features = None


@torch.no_grad()
def _write(model, rows: List[List[int]], *, max_new_tokens: int, temperature: float, top_p: Optional[float],
           seed: int, eos: List[int], features: bool = False):
    """The model's continuations of `rows` (left padded into one batch) by this package's own
    decoding loop without drafts: `generate` with a static KV cache, finished rows leaving the
    batch. Against HF `generate`, the default model in bf16, 48 rows, 2-core development machine:
    news articles (320 tokens, temperature 0.8, top-p 0.95) 487 against 162 tokens/s; greedy
    answers to summarisation requests (~600-token prompts, 128 tokens) 114 against 93 tokens/s
    (the prompts' prefill dominates).
    Returns each row's new tokens up to and including its first eos; with `features`, also
    each row's features (fp16 [n - 1, H] for its n prompt + new tokens: the writer's own LM
    head inputs, recorded while it wrote, so no second forward is needed)."""
    from ..loop.generate import generate

    device = next(model.parameters()).device
    pad = eos[0] if eos else 0
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    recorder = _FeatureRecorder(model) if features else None
    out = generate(model, ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                   temperature=float(temperature), top_k=0, top_p=top_p if temperature > 0 else None,
                   seed=seed, eos_token_id=eos, drafter=recorder, adaptive=False)  # seed: each row its own stream
    # generate stops a row right after its first eos, so its new tokens end there
    new = [row[:count] for row, count in zip(out.sequences[:, width:].cpu().tolist(), out.stats.new_tokens)]
    if recorder is None:
        return new
    # (copies: the recorder's rows are views of its buffer, made under generate's inference mode)
    return new, [recorder.done[i].clone() for i in range(len(rows))]


def _self_written(target, tokenizer, prefix: List[int], count: int, *, seed: int, max_tokens: int, batch_size: int,
                  temperature: float, min_chars: int, generation_dtype, cache, desc: str, progress: bool) -> List[str]:
    """`count` distinct texts the target writes after the token ids `prefix` (sampling at
    `temperature`, top_p 0.95, up to `max_tokens` tokens, stopping at eos); texts shorter
    than `min_chars` are dropped. `cache` (a JSON file) keeps what was written so far, so a
    run resumes, and a larger count extends the same sequence (the same seed gives the same texts)."""
    from tqdm import tqdm

    cache = Path(cache) if cache is not None else None
    state = {"seed": seed, "max_tokens": max_tokens, "batch_size": batch_size, "writer": WRITER, "turns": [],
             "attempts": 0}
    if cache is not None and cache.is_file():
        stored = json.loads(cache.read_text())
        if all(stored.get(k) == state[k] for k in ("seed", "max_tokens", "batch_size", "writer")):
            state = stored
    texts = state["turns"]
    writer = None
    eos = _eos_ids(target)
    bar = tqdm(total=count, initial=min(len(texts), count), desc=desc, unit="text", disable=not progress)
    while len(texts) < count and state["attempts"] < 4 * count // batch_size + 4:
        writer = writer or _writer(target, generation_dtype)
        new = _write(writer, [prefix] * batch_size, max_new_tokens=max_tokens, temperature=temperature,
                     top_p=0.95, seed=seed * 1000003 + state["attempts"], eos=eos)
        state["attempts"] += 1
        before = len(texts)
        for row in new:
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            if len(text) >= min_chars and text not in texts:
                texts.append(text)
        bar.update(min(len(texts), count) - min(before, count))
        if cache is not None:
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(cache)
    bar.close()
    return texts[:count]


def self_prompts(target, tokenizer, count: int, *, seed: int, max_tokens: int = 64, batch_size: int = 32,
                 generation_dtype=torch.bfloat16, cache=None, progress: bool = True) -> List[str]:
    """`count` distinct user turns written by the target itself: it continues its chat
    template right after the user-turn header, sampling (temperature 1.0, top_p 0.95), and
    stops at the end of the turn. These give chat-like training prompts without outside text.

    generation_dtype: dtype of the copy of the target that writes (None: the target itself).
    cache: a JSON file that keeps the turns written so far (resumes from it; the same seed
    gives the same turns)."""
    if count <= 0:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self_prompts: the tokenizer has no chat template to write user turns with")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False)
    prefix = tokenizer(rendered[: rendered.index(_MARK)], add_special_tokens=False)["input_ids"]
    # (The end of a user turn is the template's end-of-turn token: eos for most chat models.)
    return _self_written(target, tokenizer, prefix, count, seed=seed, max_tokens=max_tokens, batch_size=batch_size,
                         temperature=1.0, min_chars=8, generation_dtype=generation_dtype, cache=cache,
                         desc="writing user turns", progress=progress)


ARTICLE_INSTRUCTION = "Write a news article."


def self_articles(target, tokenizer, count: int, *, seed: int, max_tokens: int = 320, batch_size: int = 32,
                  generation_dtype=torch.bfloat16, cache=None, progress: bool = True) -> list:
    """`count` summarisation requests (the `summarization` workload's exact wording) over
    news articles the target writes itself, answering ARTICLE_INSTRUCTION (sampling at
    temperature 0.8, top_p 0.95, up to `max_tokens` tokens; an article cut there stays cut, as
    the workload cuts long articles). A head trained on them sees many documents to
    summarise, where the dev workload has 90: on the 90 alone it learnt those summaries
    (top-1 ~0.45 on them) but agreed with the target only ~0.2 on unseen articles.

    Returns `workloads.Request`s (ids "self-article-<i>"). cache: as for `self_prompts`."""
    from ..workloads import summarization_request

    if count <= 0:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self_articles: the tokenizer has no chat template to ask for articles with")
    prefix = render_prompts(tokenizer, [ARTICLE_INSTRUCTION])[0]  # the instruction as a user turn
    articles = _self_written(target, tokenizer, prefix, count, seed=seed + 1, max_tokens=max_tokens, batch_size=batch_size,
                             temperature=0.8, min_chars=200, generation_dtype=generation_dtype, cache=cache,
                             desc="writing articles", progress=progress)
    return [summarization_request(a, id=f"self-article-{i}") for i, a in enumerate(articles)]


def _key(ids: Sequence[int]) -> str:
    """A token sequence's cache key (sha256 of its ids)."""
    import hashlib

    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:32]


def _settings_check(folder: Path, settings: dict) -> None:
    """Refuse a work folder whose cached responses were written with other settings."""
    path = folder / "settings.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored != json.loads(json.dumps(settings)):
            diff = sorted(k for k in set(stored) | set(settings) if stored.get(k) != settings.get(k))
            raise ValueError(f"work_dir {folder} holds responses collected with other settings ({', '.join(diff)}); "
                             "use a fresh work_dir")
        return
    path.write_text(json.dumps(settings))


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _load_shards(folder: Optional[Path], prefix: str) -> dict:
    """{key: value} merged from every `<prefix>_*.pt` shard in folder."""
    out = {}
    if folder is not None:
        for path in sorted(folder.glob(f"{prefix}_*.pt")):
            out.update(torch.load(path, weights_only=True))
    return out


def _next_shard(folder: Path, prefix: str) -> Path:
    taken = [int(p.stem.rsplit("_", 1)[1]) for p in folder.glob(f"{prefix}_*.pt")]
    return folder / f"{prefix}_{max(taken, default=-1) + 1:05d}.pt"


def _example(tokens: List[int], feats: torch.Tensor, weight: torch.Tensor) -> dict:
    """One example from a sequence and its fp16 features [n - 1, H]: the log-sum-exp and
    argmax of the full logits `weight` (the target's LM head) gives at each position."""
    lse, top = [], []
    for c in range(0, feats.shape[0], 1024):  # full-vocabulary logits in chunks (memory)
        logits = feats[c : c + 1024].to(device=weight.device, dtype=weight.dtype) @ weight.T
        lse.append(logits.float().logsumexp(-1))
        top.append(logits.argmax(-1))
    return {"tokens": torch.tensor(tokens, dtype=torch.int32), "features": feats.cpu(),
            "lse": torch.cat(lse).cpu() if lse else torch.zeros(0),
            "argmax": torch.cat(top).to(torch.int32).cpu() if top else torch.zeros(0, dtype=torch.int32)}


def features_from_writer(target, generation_dtype, feature_dtype, feature_layers=()) -> bool:
    """Whether `collect` records the features while the responses are written: when the
    writer runs in the features' dtype, its own forwards give them (no second pass over the
    sequences); not with extra layers (EAGLE-3), which take the pass."""
    model_dtype = next(target.parameters()).dtype
    return not feature_layers and (generation_dtype or model_dtype) == (feature_dtype or model_dtype)


@torch.no_grad()
def collect(target, prompt_ids: List[List[int]], *, max_new_tokens: int, batch_size: int = 32,
            temperature: float = 0.0, top_p: Optional[float] = None, seed: int = 0, eos_token_id=None,
            generation_dtype=torch.bfloat16, feature_batch_tokens: int = 8192, work_dir=None,
            feature_layers: Sequence[int] = (), feature_dtype=None, progress: bool = True) -> list:
    """Self-distillation examples (see the module docstring) for each prompt: the target's
    response (greedy when temperature is 0, else sampled with temperature / top_p) and the
    target's features and labels at every position.

    batch_size: prompts answered together (similar lengths share a batch).
    generation_dtype: dtype of the copy of the target that writes the responses (None: the
        target itself); features and labels always come from the target.
    feature_batch_tokens: rows x longest sequence per feature forward.
    work_dir: cache folder: each batch of responses and of features is saved as a shard keyed
        by its token ids, so a stopped collection resumes, and a later one with more prompts
        (same settings) computes only the new ones. None keeps everything in memory.
    feature_layers: also record these hidden states of the target (transformers' numbering:
        0 the embeddings, i the output of decoder layer i) as each example's "inputs"
        (cached in their own shards, so one work folder serves heads of several layer sets).
    feature_dtype: dtype of the forward that computes the features (None: the target itself;
        torch.bfloat16: a bf16 copy, ~2x faster on CPUs with bf16 units: 1050 against ~500
        positions/s for the default model on the 2-core development machine). Equal to the
        writer's dtype (and no feature_layers), the writer records them while it writes
        (`features_from_writer`): no pass at all. The labels are the target's own LM head
        applied to those features either way. Cached in their own shards per dtype and
        source, so a work folder keeps each."""
    from tqdm import tqdm

    from ..loop.hf.attention import _decoder

    for name, value in (("batch_size", batch_size), ("feature_batch_tokens", feature_batch_tokens),
                        ("max_new_tokens", max_new_tokens)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    eos = _eos_ids(target, eos_token_id)
    folder = Path(work_dir) if work_dir is not None else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        from .common import target_identity

        _settings_check(folder, {"target": target_identity(target), "max_new_tokens": max_new_tokens,
                                 "temperature": temperature, "top_p": top_p, "seed": seed, "eos": eos,
                                 "generation_dtype": str(generation_dtype), "writer": WRITER})

    layers = [int(i) for i in feature_layers]
    own_dtype = feature_dtype is None or feature_dtype == next(target.parameters()).dtype
    from_writer = features_from_writer(target, generation_dtype, feature_dtype, layers)
    # Shards of another forward dtype or source are other data ("features" alone: a pass of
    # the target in its own dtype).
    suffix = "" if own_dtype else "-" + str(feature_dtype).replace("torch.", "")
    feature_prefix = "features" + ("-writer" if from_writer else "") + suffix
    layer_prefix = "layers-" + "-".join(map(str, layers)) + suffix
    done = _load_shards(folder, feature_prefix)
    weight = lm_head_weight(target)

    # 1) responses, batch by batch (similar prompt lengths together: little padding), and
    # with from_writer their features.
    known = _load_shards(folder, "responses")
    keys = [_key(p) for p in prompt_ids]
    todo = sorted({k: i for i, k in enumerate(keys) if k not in known}.values(), key=lambda i: (len(prompt_ids[i]), i))
    writer = None
    bar = tqdm(total=len(prompt_ids), initial=len(prompt_ids) - len(todo), desc="responses", unit="prompt",
               disable=not progress)
    for k, start in enumerate(range(0, len(todo), batch_size)):
        idx = todo[start : start + batch_size]
        writer = writer or _writer(target, generation_dtype)
        t0 = time.perf_counter()
        got = _write(writer, [prompt_ids[i] for i in idx], max_new_tokens=max_new_tokens,
                     temperature=temperature, top_p=top_p, seed=seed * 7919 + k, eos=eos, features=from_writer)
        if from_writer:
            got, feats = got
            sequences = [list(prompt_ids[i]) + r for i, r in zip(idx, got)]
            new_features = {_key(q): _example(q, f, weight) for q, f in zip(sequences, feats)}
            done.update(new_features)
            if folder is not None:  # (before the responses: a response on disk has its features)
                _save_atomic(new_features, _next_shard(folder, feature_prefix))
        new = {keys[i]: r for i, r in zip(idx, got)}
        known.update(new)
        if folder is not None:
            _save_atomic(new, _next_shard(folder, "responses"))
        bar.set_postfix({"new_tok_per_s": round(sum(map(len, got)) / (time.perf_counter() - t0), 1)})
        bar.update(len(idx))
    bar.close()
    del writer

    # 2) features and labels: one forward of the target per group of similar-length sequences.
    sequences = [list(prompt_ids[i]) + list(known[keys[i]]) for i in range(len(prompt_ids))]
    seq_keys = [_key(s) for s in sequences]
    done_layers = _load_shards(folder, layer_prefix) if layers else {}
    todo = sorted({k: i for i, k in enumerate(seq_keys) if k not in done or (layers and k not in done_layers)}.values(),
                  key=lambda i: (len(sequences[i]), i))
    groups, current = [], []
    for i in todo:
        if current and (len(current) + 1) * len(sequences[i]) > feature_batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    device = weight.device
    # (a copy in feature_dtype only when something is left to compute: a resumed run needs none)
    decoder = _decoder(_writer(target, feature_dtype)) if todo else None
    bar = tqdm(total=sum(len(sequences[i]) for i in todo), desc="features", unit="tok", disable=not progress)
    for idx in groups:
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, : len(sequences[i])] = torch.tensor(sequences[i])
        # Right padding: causal attention keeps every real position blind to the padding.
        out = decoder(input_ids=ids.to(device), use_cache=False, output_hidden_states=bool(layers))
        hidden = out.last_hidden_state
        if layers:
            stacked = torch.stack([out.hidden_states[j] for j in layers], dim=2)  # [rows, width, k, H]
            # bf16: middle layers carry "massive activations" (up to ~24k in the default model,
            # more in others) that fp16 could overflow; the heads serve in bf16 anyway.
            new_layers = {seq_keys[i]: stacked[r, : len(sequences[i]) - 1].to(torch.bfloat16).cpu() for r, i in enumerate(idx)}
            done_layers.update(new_layers)
            if folder is not None:
                _save_atomic(new_layers, _next_shard(folder, layer_prefix))
        new = {seq_keys[i]: _example(sequences[i], hidden[r, : len(sequences[i]) - 1].to(torch.float16), weight)
               for r, i in enumerate(idx) if seq_keys[i] not in done}
        done.update(new)
        if folder is not None and new:
            _save_atomic(new, _next_shard(folder, feature_prefix))
        bar.update(sum(len(sequences[i]) for i in idx))
    bar.close()
    if not layers:
        return [done[k] for k in seq_keys]
    return [{**done[k], "inputs": done_layers[k]} for k in seq_keys]

def save_examples(path, examples: list, meta: dict) -> None:
    """One file (torch.save) with every example and how they were made; written atomically."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    torch.save({"meta": meta, "examples": examples}, tmp)
    tmp.replace(path)


def load_examples(path) -> Optional[dict]:
    """What `save_examples` wrote, or None if the file is missing."""
    path = Path(path)
    return torch.load(path, weights_only=True) if path.is_file() else None


def draft_vocabulary(examples: list, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The `size` target tokens that occur most often (as text tokens and as the target's
    argmax) in the examples, plus `always` (e.g. eos); int64, sorted ascending."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ex in examples:
        counts += torch.bincount(ex["tokens"].long(), minlength=vocab_size).double()
        counts += torch.bincount(ex["argmax"].long(), minlength=vocab_size).double()
    counts += 1e-9 * torch.arange(vocab_size, 0, -1, dtype=torch.float64)  # ties: lower ids first (deterministic)
    for t in always:
        counts[int(t)] = float("inf")
    return counts.topk(size).indices.sort().values
