"""What every learned head shares: the target's identity, its frozen embedding and LM head,
the reduced draft vocabulary, and the on-disk format (safetensors + config.json).

A head directory holds `config.json` (kind, the head's shape, training facts, and `target`:
the identity of the model it was trained on) and `head.safetensors` (the head's own weights
in fp16, plus `draft_vocab`, the target token ids the head can propose). The target's
embedding and LM head are never stored: the head reads them from the target it runs on,
which is why a head refuses a target whose identity differs.
"""

import copy
import hashlib
import inspect
import json
from pathlib import Path
from typing import Optional

import torch

FORMAT = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "head.safetensors"
KINDS = ("eagle", "medusa", "mtp")


def text_config(target):
    """The target's text config (multimodal configs nest it)."""
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def decoder_layer_class(target):
    """The class of the target's decoder layers (full-attention ones for hybrids)."""
    layers = target.get_decoder().layers
    for layer in layers:
        if hasattr(layer, "self_attn"):
            return type(layer)
    raise ValueError(f"target: {type(target).__name__} has no attention decoder layer to build an MTP block from")


def lm_head_weight(target) -> torch.Tensor:
    """The target's output projection [V, H] (tied to the embedding for many models)."""
    head = target.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("target: learned heads need a causal LM whose LM head is one linear map without bias")
    return head.weight


def input_embedding(target) -> torch.nn.Module:
    """The target's token embedding module."""
    return target.get_input_embeddings()


def lm_head_hash(target) -> str:
    """sha256 (first 16 hex digits) of the target's LM head weight rounded to bfloat16.

    bf16 rounding makes the hash the same whether the target was loaded in fp32 or bf16,
    while any other weights (another checkpoint, a fine-tune) give another hash."""
    cached = getattr(target, "_specdec_lm_head_hash", None)
    weight = lm_head_weight(target)
    if cached is not None and cached[0] == weight.data_ptr():
        return cached[1]
    data = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    try:
        target._specdec_lm_head_hash = (weight.data_ptr(), digest)  # hashing 100 MB costs ~0.3 s
    except AttributeError:
        pass
    return digest


def target_identity(target) -> dict:
    """What a head records about its target and checks before use."""
    cfg = text_config(target)
    archs = getattr(target.config, "architectures", None) or [type(target).__name__]
    return {
        "architecture": archs[0],
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(lm_head_weight(target).shape[0]),
        "lm_head_sha256": lm_head_hash(target),
    }


def check_target(identity: dict, target, where: str) -> None:
    """Raise ValueError naming every field where `target` differs from the head's `identity`."""
    actual = target_identity(target)
    diff = [f"{k}: head {identity.get(k)!r}, target {actual[k]!r}" for k in actual if identity.get(k) != actual[k]]
    if diff:
        raise ValueError(f"head {where} was trained for another target ({'; '.join(diff)})")


def rope_theta(cfg) -> float:
    """The target's RoPE base (transformers 5 keeps it in rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


def write_head(out_dir, config: dict, state: dict) -> Path:
    """Write `config.json` and `head.safetensors` (floating tensors in fp16) into out_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).cpu().contiguous()
               for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **config}, indent=1) + "\n")
    return out


def read_head(path, kind: Optional[str] = None):
    """(config dict, tensors dict) of a head directory; ValueError if it is not one (of `kind`)."""
    from safetensors.torch import load_file

    folder = Path(path)
    cfg_file, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"head: {folder} is not a head directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    config = json.loads(cfg_file.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"head: {folder} has format {config.get('format')!r}, this version reads {FORMAT}")
    if kind is not None and config.get("kind") != kind:
        raise ValueError(f"head: {folder} holds a {config.get('kind')!r} head, expected {kind!r}")
    return config, load_file(str(weights))


def block_config(target):
    """The target's text config, copied, for building MTP blocks: SDPA attention (the
    drafter passes explicit masks), eager where the blocks need an additive mask
    (`additive_block_mask`), and layer-type lists extended with full attention for the layers
    past the target's last (the MTP layers' indices)."""
    cfg = copy.deepcopy(text_config(target))
    cfg._attn_implementation = "eager" if additive_block_mask(target) else "sdpa"
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, (list, tuple)):
        cfg.layer_types = list(types) + ["full_attention"] * 64
    return cfg


def additive_block_mask(target) -> bool:
    """Whether `target`'s MTP blocks run eager attention, which takes an additive mask
    (`block_mask`): soft-capped attention (Gemma 2's), which SDPA cannot do."""
    return bool(getattr(text_config(target), "attn_logit_softcapping", None))


def block_mask(mask: torch.Tensor, additive: bool, dtype) -> torch.Tensor:
    """A boolean attention mask as an MTP block's attention takes it: as is for SDPA, or
    additive (0 where allowed, the dtype's lowest value elsewhere) for eager attention."""
    if not additive:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def cache_kwarg(block) -> str:
    """The name of a transformers decoder layer's cache argument (renamed past_key_values ->
    cache across transformers versions)."""
    return "cache" if "cache" in inspect.signature(block.forward).parameters else "past_key_values"


def target_norm(target, size: int, eps: float) -> torch.nn.Module:
    """A norm of the target's own RMSNorm class (Qwen3-Next's is zero-centred: 1 + weight)."""
    cls = type(target.get_decoder().norm)
    try:
        return cls(size, eps=eps)
    except TypeError:
        return cls(size, eps)
