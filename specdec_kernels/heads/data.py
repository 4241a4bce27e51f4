"""Training data for learned heads, by self-distillation.

The target answers the training prompts itself (our `generate` with n-gram drafts, batched,
so it is cheap), and the same run records the target's features (the LM head's input) at
every position: the prefill's hidden states cover the prompt, each verify forward's accepted
path covers the generated tokens (`_Recorder`, a drafter that watches `observe`). No extra
target pass is needed. Afterwards the log-sum-exp and argmax of the target's full logits at
every position are computed from the features, so training can turn restricted-vocabulary
logits into the target's exact probabilities.

One example: `tokens int32 [n]`, `features fp16 [n - 1, H]` (feature i predicts token i + 1),
`lse fp32 [n - 1]`, `argmax int32 [n - 1]`.
"""

import json
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from ..drafters import Drafter, NgramDrafter
from .common import lm_head_weight

_MARK = "\u2063SPECDEC_USER\u2063"  # stands for the user turn when cutting the chat template


class _Recorder(Drafter):
    """Wraps a drafter and records, per original row, the target features `generate` passes
    to `observe`: the prefill's positions, then each step's accepted path."""

    needs_hidden_states = True

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.max_nodes, self.models = inner.max_nodes, inner.models
        self.features = {}

    def start(self, history, lengths, capacity):
        self.inner.start(history, lengths, capacity)
        self.rows = list(range(history.shape[0]))
        self.prefix = (lengths.long() - 1).tolist()
        self.features = {b: [] for b in self.rows}

    def observe(self, hidden_states, accepted_nodes=None, num_accepted=None):
        hidden = hidden_states.detach().to(torch.float16).cpu()
        if accepted_nodes is None:
            for i, row in enumerate(self.rows):
                self.features[row].append(hidden[i, : self.prefix[i]])
            return
        nodes, counts = accepted_nodes.long().cpu(), num_accepted.long().cpu()
        for i, row in enumerate(self.rows):
            self.features[row].append(hidden[i, nodes[i, : int(counts[i]) + 1]])

    def propose(self, history, lengths, sampling=None, budget=None):
        return self.inner.propose(history, lengths, sampling)

    def keep_rows(self, rows):
        self.inner.keep_rows(rows)
        self.rows = [self.rows[i] for i in rows.tolist()]

    def finish(self):
        self.inner.finish()


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


def self_prompts(target, tokenizer, count: int, *, seed: int, max_tokens: int = 48, batch_size: int = 8) -> List[str]:
    """`count` user turns written by the target itself: it continues its chat template right
    after the user-turn header, sampling (temperature 1.0, top_p 0.95), and stops at the end
    of the turn. These give chat-like training prompts without any outside text."""
    from ..generate import generate

    if count <= 0:
        return []
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("self_prompts: the tokenizer has no chat template to write user turns with")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False)
    prefix = rendered[: rendered.index(_MARK)]
    ids = tokenizer(prefix, add_special_tokens=False, return_tensors="pt")["input_ids"]
    turns, attempt = [], 0
    while len(turns) < count and attempt < 4 * count // batch_size + 4:
        batch = ids.expand(batch_size, -1).contiguous()
        out = generate(target, batch, max_new_tokens=max_tokens, temperature=1.0, top_p=0.95,
                       seed=seed * 1000003 + attempt, drafter=NgramDrafter())
        attempt += 1
        for row in out.sequences[:, ids.shape[1]:]:
            text = tokenizer.decode(row, skip_special_tokens=True).strip()
            if len(text) >= 8 and text not in turns:
                turns.append(text)
    return turns[:count]


@torch.no_grad()
def collect(target, prompt_ids: List[List[int]], *, max_new_tokens: int, batch_size: int = 16,
            temperature: float = 0.0, seed: int = 0, eos_token_id=None, progress: bool = True) -> list:
    """Self-distillation examples (see the module docstring) for each prompt: the target's
    response (greedy when temperature is 0) and its features at every position."""
    from tqdm import tqdm

    from ..generate import generate

    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # similar lengths share a batch
    examples = [None] * len(prompt_ids)
    weight = lm_head_weight(target)
    bar = tqdm(total=len(order), desc="collecting", unit="prompt", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompt_ids[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompt_ids[i]) :] = torch.tensor(prompt_ids[i])
            mask[r, width - len(prompt_ids[i]) :] = 1
        # Plain decoding: on a CPU every drafted node costs target compute for the whole batch,
        # and batched rows rarely all have drafts at once.
        recorder = _Recorder(Drafter())
        dev = next(target.parameters()).device
        out = generate(target, ids.to(dev), attention_mask=mask.to(dev), drafter=recorder, max_new_tokens=max_new_tokens,
                       temperature=temperature, seed=seed + start, eos_token_id=eos_token_id)
        for r, i in enumerate(idx):
            new = out.stats.new_tokens[r]
            tokens = torch.tensor(prompt_ids[i] + out.sequences[r, width : width + new].tolist(), dtype=torch.int32)
            feats = torch.cat(recorder.features[r])[: len(tokens) - 1]
            if feats.shape[0] != len(tokens) - 1:
                raise RuntimeError(f"collect: recorded {feats.shape[0]} features for {len(tokens)} tokens")
            # The target's full-vocabulary log-normaliser and argmax at every position.
            logits = feats.to(weight.device, weight.dtype) @ weight.T
            examples[i] = {"tokens": tokens, "features": feats, "lse": logits.float().logsumexp(-1).cpu(),
                           "argmax": logits.argmax(-1).to(torch.int32).cpu()}
        bar.update(len(idx))
    bar.close()
    return examples


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
