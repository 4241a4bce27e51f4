"""`train_draft_head`: train an EAGLE, Medusa or MTP head for a target by self-distillation.

Stages, each resumable from its file in `work_dir` (default `<out_dir>/work`):
1. data (`data.pt`): the target answers the prompts (plus, optionally, user turns it wrote
   itself, kept in `self_prompts.json`, and requests to summarise articles it wrote itself,
   `self_articles.json`) and its features are recorded (`heads.data`; shards
   of both passes in `collect/`, so an interrupted collection resumes batch by batch).
2. training (`checkpoint.pt`, every `checkpoint_every` steps): soft cross-entropy to the
   target's distribution over the draft vocabulary (the target's probabilities are exact:
   its full-vocabulary log-normaliser is stored per position), plus for EAGLE a smooth-L1
   regression of the predicted feature on the target's next feature (teacher forcing on the
   target's own features, with small uniform noise on the input features). A fixed number of
   steps, batch order and noise from `seed`: the same command gives the same head. Losses go
   to `<out_dir>/train_log.jsonl`, one JSON object per line.
3. the head (`head.safetensors`, fp16, and `config.json` with the target's identity).
"""

import json
import math
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from .common import KINDS, input_embedding, lm_head_weight, rope_theta, target_identity, text_config, write_head
from .data import collect, draft_vocabulary, features_from_writer, load_examples, render_prompts, save_examples, self_articles, self_prompts
from .modules import EagleHead, MedusaHeads, MtpHead, causal_attention


def head_config(target, kind: str, draft_vocab_size: int, num_heads: int = 4, feature_layers=None) -> dict:
    """The head's shape for `target` (EAGLE: the target's decoder-layer shapes, and the
    target's hidden states it fuses into its input when `feature_layers` is given)."""
    cfg = text_config(target)
    if kind == "medusa":
        return {"hidden_size": int(cfg.hidden_size), "num_heads": int(num_heads), "draft_vocab_size": int(draft_vocab_size)}
    if kind == "mtp":
        from .common import decoder_layer_class

        return {"hidden_size": int(cfg.hidden_size), "layer_index": int(cfg.num_hidden_layers),
                "block_class": decoder_layer_class(target).__name__, "draft_vocab_size": int(draft_vocab_size)}
    num_heads_q = int(cfg.num_attention_heads)
    layers = {"feature_layers": [int(i) for i in feature_layers]} if feature_layers else {}
    return {
        "hidden_size": int(cfg.hidden_size),
        "num_attention_heads": num_heads_q,
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or num_heads_q),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads_q),
        "intermediate_size": int(cfg.intermediate_size),
        "rms_norm_eps": float(getattr(cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta(cfg),
        "draft_vocab_size": int(draft_vocab_size),
        **layers,
    }


def check_mtp_target(target) -> None:
    """ValueError unless an MTP head can be trained for `target` and drafted with: the loop
    runs its family (no recurrent layers: `loop.hf.families`), every decoder layer is an
    attention layer (the block is built from that class), its logits are its LM head on its
    last hidden state (no soft-capping or scaling, one linear map without bias), and its
    decoder has a rotary embedding to give the block positions. Checked before any data is
    collected."""
    from ..loop.hf.families import unsupported_reason

    name = type(target).__name__
    why = unsupported_reason(target)
    if why is not None:
        raise ValueError(f"kind='mtp': cannot train an MTP head for {name}: the loop cannot run it ({why})")
    layers = getattr(target.get_decoder(), "layers", None)
    if not layers or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"kind='mtp': cannot train an MTP head for {name}: its decoder layers are not all attention "
                         "layers (the MTP block is built from the target's decoder-layer class)")
    cfg = text_config(target)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError(f"kind='mtp': cannot train an MTP head for {name}: it post-processes its logits "
                         "(final_logit_softcapping / logit_scale), so its LM head input does not give its distribution")
    lm_head_weight(target)  # ValueError for an LM head with a bias
    if getattr(target.get_decoder(), "rotary_emb", None) is None:
        raise ValueError(f"kind='mtp': cannot train an MTP head for {name}: its decoder has no rotary_emb "
                         "(the MTP block takes the target's rotary position embeddings)")
    build_mtp_head(target, head_config(target, "mtp", 1), device="meta")  # the block builds from the config


def build_mtp_head(target, config: dict, device=None) -> MtpHead:
    """An `MtpHead` for `target`: its block is the target's own decoder-layer class at index
    num_hidden_layers (what `MtpDrafter` builds to load it; MoE targets get their MoE block
    there), its norms the target's RMSNorm class, its rotary embedding the target's."""
    from .common import additive_block_mask, block_config, decoder_layer_class, target_norm

    cfg = text_config(target)
    hidden, eps = int(cfg.hidden_size), float(getattr(cfg, "rms_norm_eps", 1e-6))
    with torch.device(device or "cpu"):
        block = decoder_layer_class(target)(block_config(target), int(config["layer_index"]))
        return MtpHead(config, block, lambda: target_norm(target, hidden, eps), target.get_decoder().rotary_emb,
                       additive_mask=additive_block_mask(target))


def eagle3_layers(target) -> List[int]:
    """EAGLE-3's choice of hidden states for a target of L decoder layers: a low, a middle
    and a high one (the outputs of layers 2, L // 2 and L - 3), in transformers' numbering."""
    num = int(text_config(target).num_hidden_layers)
    if num < 4:
        raise ValueError(f"feature_layers='eagle3' needs a target of at least 4 layers, this one has {num}")
    return [2, num // 2, num - 3]


def check_feature_layers(target, feature_layers) -> List[int]:
    """`feature_layers` as a list of valid hidden-state indices of `target` ('eagle3':
    `eagle3_layers`; None or empty: [])."""
    if not feature_layers:
        return []
    if isinstance(feature_layers, str):
        if feature_layers != "eagle3":
            raise ValueError(f"feature_layers: expected 'eagle3' or a list of layer indices, got {feature_layers!r}")
        return eagle3_layers(target)
    num = int(text_config(target).num_hidden_layers)
    layers = [int(i) for i in feature_layers]
    bad = [i for i in layers if not 0 <= i <= num]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers {layers}: need distinct hidden-state indices in 0 .. {num} "
                         f"(0 the embeddings, i the output of decoder layer i)")
    return layers


def _windows(examples, max_len: int, kind: str, num_heads: int):
    """(example, start, length) training windows: EAGLE inputs i = (f_i, x_{i+1}) for
    i < n - 2; Medusa inputs f_t for t < n - 1. Long examples are cut into max_len pieces."""
    out = []
    for e, ex in enumerate(examples):
        m = ex["features"].shape[0]
        n_inputs = m - 1  # EAGLE: input i needs f_{i+1} as its target; Medusa: head 1 at t needs f_{t+1}
        for s in range(0, max(n_inputs, 0), max_len):
            out.append((e, s, min(max_len, n_inputs - s)))
    return out


def _batches(windows, batch_tokens: int, generator: torch.Generator):
    """Shuffled windows grouped into batches of at most batch_tokens (rows x longest)."""
    order = torch.randperm(len(windows), generator=generator).tolist()
    batches = []
    for chunk in range(0, len(order), 64):  # sort within chunks: little padding, still shuffled
        group = sorted((windows[i] for i in order[chunk : chunk + 64]), key=lambda w: w[2])
        current = []
        for w in group:
            if current and (len(current) + 1) * max(w[2], max(c[2] for c in current)) > batch_tokens:
                batches.append(current)
                current = []
            current.append(w)
        if current:
            batches.append(current)
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in perm]


def drafted_mask(depth: int, t: int, device) -> torch.Tensor:
    """bool [T, (depth + 1) T]: what query i of unrolled pass `depth` sees of the keys of
    passes 0 .. depth (in that order): pass 0's keys j <= i - depth (the drafter's cache
    entries built from the target's true features), pass m's key at i - depth + m for
    0 < m <= depth (its drafted ancestors, and its own new key for m = depth). depth 0:
    causal."""
    i = torch.arange(t, device=device)
    blocks = [i[None, :] <= i[:, None] - depth]
    blocks += [i[None, :] == i[:, None] - depth + m for m in range(1, depth + 1)]
    return torch.cat(blocks, dim=1)


class PassCache:
    """The keys and values of an MTP block's earlier unrolled passes, as a transformers cache:
    each `update` (the block's attention calls it with this pass's keys/values [B, H, T, D])
    keeps them and returns every pass's so far, concatenated on the sequence dim (the layout
    `drafted_mask` indexes)."""

    def __init__(self):
        self.keys, self.values = [], []

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, 2), torch.cat(self.values, 2)

    def get_seq_length(self, *args, **kwargs) -> int:
        return sum(k.shape[2] for k in self.keys)


def mtp_passes(run_head, features, token_embeds, positions, unroll: int) -> list:
    """An MTP head's outputs g for drafting depths 1 .. unroll + 1 over training windows (the
    training-time test of `eagle_passes`, for a block of the target's own class): pass 0 is
    the head on the target's true features (causal); unrolled pass d feeds it pass d - 1's
    fed-deeper output x_{i-1} (detached) with the same tokens, attending through `PassCache`
    as the drafter's depth-d node does (`drafted_mask`).

    run_head(features, token_embeds, positions, cache, mask) -> (g, x)."""
    cache = PassCache() if unroll else None
    t = features.shape[1]
    outs = []
    fed = features
    for d in range(unroll + 1):
        mask = drafted_mask(d, t, features.device)[None]
        g, x = run_head(fed, token_embeds, positions, cache, mask)
        outs.append(g)
        fed = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1].detach()], 1)
    return outs


def drafted_attention(pass_kv):
    """The attention of unrolled pass d = len(pass_kv) (the drafter's depth-d tree node):
    query i sees the first pass's keys j <= i - d (entries built from the target's true
    features, as in the drafter's cache), pass m's key at i - d + m for 0 < m < d (its drafted
    ancestors) and its own new key. pass_kv: the (keys, values) [B, T, Hkv, D] of passes 0 .. d - 1."""
    def attend(q, k, v):
        mask = drafted_mask(len(pass_kv), q.shape[1], q.device)
        keys = torch.cat([kv[0] for kv in pass_kv] + [k.to(pass_kv[0][0].dtype)], 1)
        values = torch.cat([kv[1] for kv in pass_kv] + [v.to(pass_kv[0][1].dtype)], 1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
                                             values.transpose(1, 2).to(q.dtype), attn_mask=mask,
                                             enable_gqa=q.shape[2] != keys.shape[2])
        return out.transpose(1, 2)
    return attend


def eagle_passes(run_head, features, token_embeds, positions, unroll: int) -> list:
    """An EAGLE head's outputs for drafting depths 1 .. unroll + 1 over training windows
    (training-time test): pass 0 is the head on the target's true features f_i (causal);
    unrolled pass d feeds it pass d - 1's prediction g_{i-1} of f_i instead, attending as the
    drafter's depth-d node does (`drafted_attention`), so each pass trains what the drafter
    computes at that depth. Predictions fed forward are detached.

    run_head(features, token_embeds, positions, attend) -> g [B, T, H]; returns [g_0, .., g_unroll]."""
    pass_kv = []  # each pass's keys and values, for the passes after it

    def keeping(attend):
        def run(q, k, v):
            pass_kv.append((k, v))
            return attend(q, k, v)
        return run

    outs = [run_head(features, token_embeds, positions, keeping(causal_attention) if unroll else None)]
    for d in range(1, unroll + 1):
        fed = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1].detach()], 1)
        attend = drafted_attention(list(pass_kv))
        outs.append(run_head(fed, token_embeds, positions, keeping(attend) if d < unroll else attend))
    return outs


class _Trainer:
    """Loss computation for one head kind on padded batches of windows."""

    def __init__(self, kind, head, target, examples, num_heads, reg_weight, noise, autocast=None, unroll=0,
                 prompt_weight=1.0):
        self.kind, self.head, self.examples = kind, head, examples
        self.unroll, self.prompt_weight = unroll, prompt_weight
        # bf16 autocast for the head's forward/backward and its logits (CPU bf16 matrix
        # units: several times faster); the target's labels stay fp32.
        self.autocast = autocast
        self.num_heads, self.reg_weight, self.noise = num_heads, reg_weight, noise
        self.device = next(target.parameters()).device
        vocab = head.draft_vocab.to(self.device)
        self.w_draft = lm_head_weight(target).detach()[vocab].float()  # [N, H], frozen
        self.w_low = self.w_draft.to(autocast) if autocast is not None else self.w_draft
        self.embed = input_embedding(target)
        self.vocab = vocab

    def _pad(self, windows, key, offset, length_extra=0, fill=0):
        rows = []
        width = max(w[2] for w in windows) + length_extra
        for e, s, n in windows:
            t = self.examples[e][key][s + offset : s + offset + n + length_extra]
            pad = width - t.shape[0]
            if pad:
                t = torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype)])
            rows.append(t)
        return torch.stack(rows).to(self.device)

    def _target_logprobs(self, feats, lse):
        return (feats @ self.w_draft.T) - lse[..., None]

    def _draft_logits(self, g):
        return (g.to(self.w_low.dtype) @ self.w_low.T).float()

    @staticmethod
    def _soft_ce(logits, p, neg_entropy):
        """(-sum p log q, sum p (log p - log q), argmax q) per position, q = softmax(logits);
        one fused cross-entropy pass (p sums to the target's mass on the draft vocabulary).
        neg_entropy: sum p log p per position (the same for every pass over one batch)."""
        shape = logits.shape[:-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), p.reshape(-1, p.shape[-1]), reduction="none").view(shape)
        return ce, ce.detach() + neg_entropy, logits.detach().argmax(-1)

    def _autocast(self, fn, *args):
        """fn(*args) in the trainer's autocast (fp32 out), or as is without one."""
        if self.autocast is None:
            return fn(*args)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return fn(*args).float()

    def _run_head(self, *args):
        return self._autocast(self.head, *args)

    def _run_mtp(self, features, token_embeds, positions, cache, mask):
        """An MTP head's (g, x) in the trainer's autocast (fp32 out)."""
        if self.autocast is None:
            return self.head(features, token_embeds, positions, cache, mask, return_hidden=True)
        with torch.autocast(self.device.type, dtype=self.autocast):
            g, x = self.head(features, token_embeds, positions, cache, mask, return_hidden=True)
        return g.float(), x.float()

    def _noisy(self, x, rms_of, generator):
        """x plus uniform noise of `noise` times the RMS of `rms_of` (per position)."""
        scale = rms_of.pow(2).mean(-1, keepdim=True).sqrt()
        return x + (torch.rand(x.shape, generator=generator) * 2 - 1).to(self.device) * self.noise * scale

    def loss(self, windows, generator: Optional[torch.Generator]):
        """Mean loss over the batch and a dict of metrics (sums and counts)."""
        width = max(w[2] for w in windows)
        valid = (torch.arange(width)[None, :] < torch.tensor([w[2] for w in windows])[:, None]).to(self.device)
        if self.kind in ("eagle", "mtp"):  # (an MTP head trains as EAGLE's does)
            feats = self._pad(windows, "features", 0, 1).float()  # f_s .. f_{s+n}
            tokens = self._pad(windows, "tokens", 1).long()  # x_{s+1} .. x_{s+n}
            lse, argmax = self._pad(windows, "lse", 1), self._pad(windows, "argmax", 1).long()
            inp, tgt = feats[:, :-1], feats[:, 1:]
            noisy = generator is not None and self.noise > 0
            if self.head.fuse is not None:  # EAGLE-3: the input is the fusion of several layers
                layers = self._pad(windows, "inputs", 0).float()  # [B, W, k, H]
                inp = self._autocast(self.head.input_features, self._noisy(layers, layers, generator) if noisy else layers)
            elif noisy:
                inp = self._noisy(inp, tgt, generator)
            positions = torch.tensor([w[1] for w in windows], device=self.device)[:, None] + torch.arange(width, device=self.device)
            with torch.no_grad():
                emb = self.embed(tokens).float()
            if self.kind == "mtp":
                outs = mtp_passes(self._run_mtp, inp, emb, positions, self.unroll)
            else:
                outs = eagle_passes(self._run_head, inp, emb, positions, self.unroll)
            # Input i predicts token s + i + 2: a response token, or a prompt token (weighted
            # prompt_weight: drafting only ever happens in responses).
            prompt_len = torch.tensor([self.examples[e]["prompt_len"] for e, _, _ in windows], device=self.device)
            response = (positions + 2) >= prompt_len[:, None]
            weight = torch.where(response, 1.0, float(self.prompt_weight))
            with torch.no_grad():
                logp = self._target_logprobs(tgt, lse)
                p = logp.exp()
                neg_entropy = (p * logp).sum(-1)
            loss, metrics = 0.0, {}
            for d, g in enumerate(outs):
                # Pass d's output at position i drafts the token at depth d + 1; positions
                # i < d have no chain of d predictions to feed.
                ok = valid & (torch.arange(width, device=self.device) >= d)[None, :]
                ce, kl, top = self._soft_ce(self._draft_logits(g), p, neg_entropy)
                reg = F.smooth_l1_loss(g, tgt, reduction="none").mean(-1)
                w = ok * weight
                total = w.sum().clamp(min=1e-6)
                loss = loss + (ce * w).sum() / total + self.reg_weight * (reg * w).sum() / total
                hit = self.vocab[top] == argmax
                sfx = "" if d == 0 else str(d + 1)
                metrics.update({f"ce{sfx}": float((ce.detach() * ok).sum()), f"kl{sfx}": float((kl * ok).sum()),
                                f"acc{sfx}": float((hit & ok).sum()), f"n{sfx}": int(ok.sum()),
                                f"racc{sfx}": float((hit & ok & response).sum()), f"rn{sfx}": int((ok & response).sum())})
                if d == 0:
                    metrics["reg"] = float((reg.detach() * ok).sum())
            return loss, metrics
        # Medusa: head k at position t learns the target's distribution at t + k.
        k_max = self.num_heads
        feats = self._pad(windows, "features", 0, k_max).float()  # f_s .. f_{s+n-1+K}
        lse, argmax = self._pad(windows, "lse", 0, k_max), self._pad(windows, "argmax", 0, k_max).long()
        avail = torch.tensor([self.examples[e]["features"].shape[0] - s for e, s, _ in windows], device=self.device)
        outs = self._run_head(feats[:, :width])  # [B, W, K, H]
        loss, metrics = 0.0, {"n": int(valid.sum())}
        for k in range(1, k_max + 1):
            ok = valid & ((torch.arange(width, device=self.device)[None, :] + k) < avail[:, None])
            with torch.no_grad():
                logp = self._target_logprobs(feats[:, k : k + width], lse[:, k : k + width])
                p = logp.exp()
                neg_entropy = (p * logp).sum(-1)
            ce, kl, top = self._soft_ce(self._draft_logits(outs[:, :, k - 1]), p, neg_entropy)
            hit = self.vocab[top] == argmax[:, k : k + width]
            cnt = ok.sum().clamp(min=1)
            loss = loss + (0.8 ** (k - 1)) * (ce * ok).sum() / cnt
            ce = ce.detach()
            metrics.update({f"ce{k}": float((ce * ok).sum()), f"kl{k}": float((kl * ok).sum()),
                            f"acc{k}": float((hit & ok).sum()), f"n{k}": int(ok.sum())})
        return loss, metrics


def _data_request(prompts, self_prompt_count, seed, max_new_tokens, generation_dtype, self_article_count=0,
                  feature_layers=(), feature_dtype=None, features_from_writer=False) -> str:
    """sha256 of what the data stage was asked for (prompts and collection settings): data
    collected for another request is collected again (from the response cache)."""
    import hashlib

    def plain(p):
        if isinstance(p, torch.Tensor):
            return p.reshape(-1).tolist()
        if isinstance(p, (str, dict)):
            return p
        if isinstance(p, (list, tuple)):
            return [int(t) for t in p]
        return repr(p)  # a workloads.Request (a dataclass: its repr holds every field)

    request = [[plain(p) for p in prompts], int(self_prompt_count), int(seed), int(max_new_tokens), str(generation_dtype)]
    if self_article_count:  # (appended only when asked for: earlier requests keep their hash)
        request.append({"self_articles": int(self_article_count)})
    if feature_layers:
        request.append({"feature_layers": [int(i) for i in feature_layers]})
    if feature_dtype is not None:
        request.append({"feature_dtype": str(feature_dtype)})
    if features_from_writer:
        request.append({"features_from": "writer"})
    text = json.dumps(request, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _summary(metrics_list, kind, num_heads) -> dict:
    total = {}
    for m in metrics_list:
        for k, v in m.items():
            total[k] = total.get(k, 0) + v
    if kind in ("eagle", "mtp"):
        n = max(total.get("n", 0), 1)
        out = {k: round(total[k] / n, 5) for k in ("ce", "kl", "reg", "acc")}
        out["racc"] = round(total["racc"] / max(total["rn"], 1), 5)  # top-1 agreement on response tokens
        depth = 2
        while f"n{depth}" in total:  # the unrolled passes
            n_d = max(total[f"n{depth}"], 1)
            out.update({f"{k}{depth}": round(total[f"{k}{depth}"] / n_d, 5) for k in ("ce", "kl", "acc")})
            out[f"racc{depth}"] = round(total[f"racc{depth}"] / max(total[f"rn{depth}"], 1), 5)
            depth += 1
        return out
    out = {}
    for k in range(1, num_heads + 1):
        n = max(total.get(f"n{k}", 0), 1)
        out.update({f"ce{k}": round(total[f"ce{k}"] / n, 5), f"kl{k}": round(total[f"kl{k}"] / n, 5),
                    f"acc{k}": round(total[f"acc{k}"] / n, 5)})
    return out


def train_draft_head(
    target,
    prompts: Sequence,
    *,
    kind: str = "eagle",
    out_dir,
    tokenizer=None,
    work_dir=None,
    max_new_tokens: int = 128,
    self_prompt_count: int = 0,
    self_article_count: int = 0,
    draft_vocab_size: int = 8192,
    num_heads: int = 4,
    steps: int = 1000,
    batch_tokens: int = 2048,
    max_len: int = 1024,
    lr: float = 1e-3,
    reg_weight: float = 1.0,
    noise: float = 0.05,
    unroll: int = 2,
    prompt_weight: float = 1.0,
    feature_layers=None,
    eval_fraction: float = 0.05,
    seed: int = 0,
    collect_batch_size: int = 32,
    generation_dtype=torch.bfloat16,
    feature_dtype=None,
    checkpoint_every: int = 50,
    log_every: int = 10,
    threads: Optional[int] = None,
    mixed_precision: bool = True,
    progress: bool = True,
    notes: Optional[dict] = None,
) -> Path:
    """Train a draft head for `target` by self-distillation and save it in `out_dir`.

    Args:
        target: a transformers causal LM (Llama-like: one linear LM head); trained on its device.
        prompts: training prompts: `workloads.Request`s, dicts with "prompt" (a user turn) or
            "text" (raw text to continue), strs (user turns), or token-id lists. The target
            answers them.
        kind: "eagle" (one decoder layer on the target's features), "medusa" (num_heads
            residual heads) or "mtp" (a DeepSeek-V3-layout MTP layer, `MtpHead`, whose block
            is a decoder layer of the target's own class: EAGLE's data and losses, unrolled
            passes included; the head directory holds it under its checkpoint names, so
            `MtpDrafter(target, out_dir)` drafts with it; `check_mtp_target` says which
            targets cannot have one).
        out_dir: where `head.safetensors`, `config.json` and `train_log.jsonl` are written.
        tokenizer: the target's tokenizer (default: loaded from the target's name_or_path).
        work_dir: resumable state (collected data, checkpoints); default `<out_dir>/work`.
        max_new_tokens: length of each response the target writes.
        self_prompt_count: extra user turns the target writes itself (chat-like data).
        self_article_count: extra summarisation requests over news articles the target
            writes itself (`data.self_articles`: many documents to summarise, where the dev
            workload has 90).
        draft_vocab_size: the head proposes only the N most frequent tokens of the data
            (cheaper drafting and training); >= the vocabulary size keeps every token.
        steps, batch_tokens, max_len, lr, reg_weight, noise: optimisation (AdamW, warmup then
            cosine decay to lr / 10; batches of at most batch_tokens positions).
        unroll: EAGLE and MTP: how many drafted depths to also train on the head's own predictions
            (training-time test, as in EAGLE-3). Unrolled pass d feeds the head its previous
            pass's predicted features, with the true entries up to d positions back and the
            drafted ancestors as context, exactly as the drafter's depth-d tree node sees
            them; its losses are ce{d+1}/kl{d+1}/acc{d+1} (the token at depth d + 1).
            0: only the first depth (the head always fed the target's true features); True
            counts as 1. Each pass adds about the first pass's compute. An MTP head's
            unrolled pass feeds its previous pass's block output x (what `MtpDrafter` feeds
            a deeper node in the DeepSeek layout), `mtp_passes`.
        prompt_weight: EAGLE: weight of the positions that predict a prompt token, against 1
            for response tokens (drafting only happens in responses; a summarisation prompt
            is ~5x longer than its answer). Metrics racc* are top-1 agreement on response tokens.
            On the default model's data 0.2 did not beat 1 (held-out racc 0.439 against 0.445).
        feature_layers: EAGLE: None (the head reads the target's LM head input), 'eagle3'
            (`eagle3_layers`: a low, a middle and a high layer, as EAGLE-3) or a list of the
            target's hidden-state indices (0 the embeddings, i the output of decoder layer
            i) fused into the head's input.
        eval_fraction: share of the examples held out for the validation losses.
        seed: makes data collection, batch order, noise and initialisation reproducible.
        collect_batch_size: prompts the target answers together while collecting.
        generation_dtype: dtype of the copy of the target that writes the responses and user
            turns (bfloat16: ~2x faster batched decoding on CPUs with bf16 units; None: the
            target itself). The labels always come from the target's own LM head.
        feature_dtype: dtype of the forward that computes the features (None: the target
            itself; torch.bfloat16: a bf16 copy, ~2x faster on CPUs with bf16 units). On the
            default model's data a head trained 400 steps on bf16-pass features agreed with
            the target as often, on features of the fp32 target, as one trained on fp32-pass
            features (0.413 / 0.382 / 0.378 at depths 1 / 2 / 3 against 0.413 / 0.383 / 0.376;
            its KL 1.99 against 1.98). Equal to generation_dtype (without feature_layers):
            the writer records the features as it writes, no pass (`data.features_from_writer`).
        threads: torch.set_num_threads for the whole run (None: leave as is).
        mixed_precision: run the head and its logits in bfloat16 autocast (the target's
            labels stay fp32); ~1.5x faster on CPUs with bf16 units, slightly different numbers.
        notes: extra facts stored under config["training"] (e.g. the command line).

    Returns:
        out_dir as a Path. Re-running with the same out_dir resumes where it stopped.
    """
    from tqdm import tqdm

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "mtp":
        check_mtp_target(target)  # before collecting any data
    for name, value in (("steps", steps), ("batch_tokens", batch_tokens), ("max_len", max_len), ("num_heads", num_heads),
                        ("draft_vocab_size", draft_vocab_size), ("max_new_tokens", max_new_tokens)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if int(unroll) < 0:
        raise ValueError(f"unroll must be >= 0, got {unroll}")
    if not 0.0 <= float(prompt_weight) <= 1.0:
        raise ValueError(f"prompt_weight must be in [0, 1], got {prompt_weight}")
    if feature_layers and kind != "eagle":
        raise ValueError("feature_layers: only EAGLE heads read several layers of the target")
    layers = check_feature_layers(target, feature_layers)
    if threads is not None:
        torch.set_num_threads(int(threads))
    out = Path(out_dir)
    work = Path(work_dir) if work_dir is not None else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    identity = target_identity(target)
    target.eval()
    if tokenizer is None and (self_prompt_count or self_article_count or not all(isinstance(p, (list, tuple, torch.Tensor)) for p in prompts)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)

    # 1) data (collected again, from the cache in work/collect, when the request changed)
    if feature_dtype == next(target.parameters()).dtype:
        feature_dtype = None  # the target itself: the same data
    from_writer = features_from_writer(target, generation_dtype, feature_dtype, layers)
    request = _data_request(prompts, self_prompt_count, seed, max_new_tokens, generation_dtype, self_article_count, layers,
                            feature_dtype, from_writer)
    stored = load_examples(work / "data.pt")
    if stored is not None and stored["meta"].get("target") != identity:
        raise ValueError(f"work_dir {work} holds data collected from another target; use a fresh work_dir")
    if stored is not None and (stored["meta"].get("request") != request
                               or any("prompt_len" not in ex for ex in stored["examples"])):
        stored = None  # (data written before prompt lengths were kept: rebuilt from the cache)
    if stored is None:
        t0 = time.perf_counter()
        turns = self_prompts(target, tokenizer, self_prompt_count, seed=seed, batch_size=collect_batch_size,
                             generation_dtype=generation_dtype, cache=work / "self_prompts.json", progress=progress)
        articles = self_articles(target, tokenizer, self_article_count, seed=seed, batch_size=collect_batch_size,
                                 generation_dtype=generation_dtype, cache=work / "self_articles.json", progress=progress)
        ids = render_prompts(tokenizer, list(prompts) + turns + articles)
        if not ids:
            raise ValueError("prompts: no usable prompt")
        examples = collect(target, ids, max_new_tokens=max_new_tokens, batch_size=collect_batch_size, seed=seed,
                           generation_dtype=generation_dtype, work_dir=work / "collect", feature_layers=layers,
                           feature_dtype=feature_dtype, progress=progress)
        for ex, p in zip(examples, ids):
            ex["prompt_len"] = len(p)
        meta = {"target": identity, "request": request, "prompts": len(ids), "self_prompts": len(turns),
                "self_articles": len(articles), "max_new_tokens": max_new_tokens,
                "generation_dtype": str(generation_dtype).replace("torch.", ""),
                "feature_dtype": "model" if feature_dtype is None else str(feature_dtype).replace("torch.", ""),
                "features_from": "writer" if from_writer else "forward",
                "positions": int(sum(ex["features"].shape[0] for ex in examples)),
                "response_tokens": int(sum(ex["tokens"].numel() - len(p) for ex, p in zip(examples, ids))),
                "collect_s": round(time.perf_counter() - t0, 1)}
        save_examples(work / "data.pt", examples, meta)
        stored = {"meta": meta, "examples": examples}
    examples, data_meta = stored["examples"], stored["meta"]

    # 2) model, split, vocabulary
    cfg_text = text_config(target)
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    vocab_size = identity["vocab_size"]
    vocab = draft_vocabulary(examples, draft_vocab_size, vocab_size, always=eos)
    config = head_config(target, kind, len(vocab), num_heads, layers)
    head = build_mtp_head(target, config) if kind == "mtp" else {"eagle": EagleHead, "medusa": MedusaHeads}[kind](config)
    head.reset_parameters(torch.Generator().manual_seed(seed))
    head.draft_vocab.copy_(vocab)
    device = next(target.parameters()).device
    head.to(device)
    split = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    n_eval = int(round(eval_fraction * len(examples)))
    eval_examples = [examples[i] for i in split[:n_eval]]
    train_examples = [examples[i] for i in split[n_eval:]]
    coverage = float(sum(torch.isin(ex["argmax"].long(), vocab).sum() for ex in examples) /
                     max(sum(ex["argmax"].numel() for ex in examples), 1))
    low = torch.bfloat16 if mixed_precision else None
    unrolled = int(unroll) if kind in ("eagle", "mtp") else 0
    trainer = _Trainer(kind, head, target, train_examples, num_heads, reg_weight, noise, low, unrolled, prompt_weight)
    eval_trainer = (_Trainer(kind, head, target, eval_examples, num_heads, reg_weight, noise, low, unrolled, prompt_weight)
                    if eval_examples else None)
    windows = _windows(train_examples, max_len, kind, num_heads)
    if not windows:
        raise ValueError("prompts: the collected examples are too short to train on")
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, min(100, steps // 10))

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        progress_ = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_)))

    # 3) resume
    step, noise_gen = 0, torch.Generator().manual_seed(seed + 2)
    ckpt_path = work / "checkpoint.pt"
    if ckpt_path.is_file():
        # On the CPU: load_state_dict moves the weights and the optimiser state to the head's device, and
        # the noise generator is a CPU one (a checkpoint written on a GPU resumes on a CPU too).
        ckpt = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        if ckpt.get("request") != request:
            raise ValueError(f"{ckpt_path} was trained on other data (other prompts or collection settings); "
                             "remove it to train on the new data")
        if ckpt["config"] != config or ckpt["kind"] != kind or int(ckpt.get("unroll", 0)) != unrolled \
                or float(ckpt.get("prompt_weight", 1.0)) != float(prompt_weight):
            raise ValueError(f"{ckpt_path} is a checkpoint of another head configuration; use a fresh work_dir")
        head.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        noise_gen.set_state(ckpt["noise_gen"])
        step = ckpt["step"]
    log_path = out / "train_log.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    if step == 0 and log_path.exists():
        log_path.unlink()

    def log(row):
        with open(log_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def evaluate():
        if eval_trainer is None:
            return {}
        head.eval()
        metrics = []
        with torch.no_grad():
            eval_windows = _windows(eval_examples, max_len, kind, num_heads)
            for i in range(0, len(eval_windows), 4):
                metrics.append(eval_trainer.loss(eval_windows[i : i + 4], None)[1])
        head.train()
        return {"val_" + k: v for k, v in _summary(metrics, kind, num_heads).items()}

    def save_checkpoint():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"step": step, "kind": kind, "config": config, "unroll": unrolled, "prompt_weight": prompt_weight, "request": request, "model": head.state_dict(), "optim": optim.state_dict(),
                    "noise_gen": noise_gen.get_state()}, tmp)
        tmp.replace(ckpt_path)

    if step == 0:
        log({"event": "start", "kind": kind, "positions": data_meta["positions"], "examples": len(examples),
             "train_windows": len(windows), "draft_vocab": len(vocab), "argmax_coverage": round(coverage, 5),
             **evaluate()})
    head.train()
    t_start, window_metrics = time.perf_counter(), []
    bar = tqdm(total=steps, initial=step, desc=f"training {kind}", unit="step", disable=not progress)
    epoch_batches, epoch = [], -1
    consumed = step
    while step < steps:
        # Batch order: epoch e is a permutation seeded by (seed, e); resuming skips what was done.
        if not epoch_batches:
            epoch += 1
            epoch_batches = _batches(windows, batch_tokens, torch.Generator().manual_seed(seed * 7919 + epoch))
            if consumed >= len(epoch_batches):
                consumed -= len(epoch_batches)
                epoch_batches = []
                continue
            epoch_batches, consumed = epoch_batches[consumed:], 0
        batch = epoch_batches.pop(0)
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        loss, metrics = trainer.loss(batch, noise_gen)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        window_metrics.append(metrics)
        bar.update(1)
        if step % log_every == 0 or step == steps:
            row = {"step": step, "epoch": epoch, "lr": round(lr_at(step - 1), 7), "loss": round(float(loss.detach()), 5),
                   **_summary(window_metrics, kind, num_heads), "elapsed_s": round(time.perf_counter() - t_start, 1)}
            bar.set_postfix({k: row[k] for k in row if k in ("kl", "acc", "racc", "racc2", "kl1", "acc1")})
            log(row)
            window_metrics = []
        if step % checkpoint_every == 0 or step == steps:
            if step % (checkpoint_every * 4) == 0 or step == steps:
                log({"step": step, **evaluate()})
            save_checkpoint()
    bar.close()

    final = {}
    if log_path.exists():
        rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        train_rows = [r for r in rows if "loss" in r]
        val_rows = [r for r in rows if any(k.startswith("val_") for k in r)]
        final = {"train": train_rows[-1] if train_rows else {}, "val": val_rows[-1] if val_rows else {}}
    training = {"steps": steps, "seed": seed, "lr": lr, "batch_tokens": batch_tokens, "max_len": max_len,
                "mixed_precision": mixed_precision,
                "reg_weight": reg_weight, "noise": noise, "unroll": unrolled, "prompt_weight": prompt_weight, "argmax_coverage": round(coverage, 5), "data": data_meta,
                "final": final, **(notes or {})}
    state = head.checkpoint_state(int(text_config(target).num_hidden_layers)) if kind == "mtp" else dict(head.state_dict())
    write_head(out, {"kind": kind, "head": config, "target": identity, "training": training}, state)
    return out
