"""`MtpDrafter`: speculate with the multi-token-prediction (MTP) layers a model ships.

DeepSeek-V3/R1, GLM-4.5/4.6, Qwen3-Next and MiMo checkpoints hold, besides the model,
one or more MTP layers that transformers drops when it loads the model. An MTP layer at
index i reads the target's hidden state h_i (the LM head's input, the one whose logits
predicted token i + 1) and the embedding of token i + 1, and predicts token i + 2:

    x   = proj(concat(norm_e(embed(t_{i+1})), norm_h(h_i)))      (MiMo: the halves swapped)
    x   = decoder_block(x)                                        (a decoder layer of the target's own kind)
    out = lm_head(final_norm(x))

with the target's embedding and LM head. Drafting deeper feeds the layer's output back as
the next h (DeepSeek-V3 and GLM feed x, MiMo and Qwen3-Next the normed x, as their MTP
modules return them) with the drafted token: layer d - 1 drafts depth d, the layers reused
in turn when the tree is deeper than the model has layers (as vLLM does).

This is the structure of an EAGLE head (`EagleDrafter`: a feature buffer from `observe`, a
one-layer KV cache caught up on the accepted tokens each step, trees grown one depth per
forward under a tree mask, best-first with path probabilities as node scores, sampled
children with their draft probabilities), so `MtpDrafter` shares that machinery; only the
network and where its weights come from differ. The MTP block is built from the target's
decoder-layer class and config (dense, MoE, MLA alike: the layer index past the target's
last makes MoE models build their MoE block) and loaded straight from the checkpoint's
safetensors; the embedding and LM head are the target's own tensors (no copies).

Layouts (key names as in the published checkpoints and in vLLM's / SGLang's MTP models):

    deepseek   DeepSeek-V3/R1/V3.x, GLM-4.5/4.6: `model.layers.{N + k}.` with `enorm`, `hnorm`,
               `eh_proj`, `shared_head.norm`, and copies of the embedding
               (`embed_tokens`) and LM head (`shared_head.head`); every other key under
               the prefix is the decoder block.
    mimo       MiMo: `model.mtp_layers.{k}.` with `token_layernorm`, `hidden_layernorm`,
               `input_proj` (applied to concat(hidden, embedding)), `final_layernorm`.
    qwen3_next Qwen3-Next: `mtp.` with `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`,
               `norm` (one final norm for all layers) and the blocks under `mtp.layers.{k}.`.

N is the target's num_hidden_layers. As vLLM does for DeepSeek, GLM and MiMo, the
embedding input at position 0 is zeroed (SGLang does not; it changes only the entry of
position 0). Embedding / LM-head copies in the checkpoint are compared with the target's:
equal (as DeepSeek-V3 ships them) the target's are used; different, the layer keeps its own
(the published forward uses it).

With several MTP layers (none of the published checkpoints above has more than one), layer k
(k >= 1) keeps its own cache of the entries whose inputs are known: index i holds
(layer k - 1's output at i, token i + 1 + k), for i + 1 + k inside the history. A tree node of
depth d is fed to layer d mod K and sees that layer's known entries and its own path there.

A head directory written by `train_draft_head(kind="mtp")` (`specdec train-draft --kind mtp`,
for targets that ship no MTP layers) is such a checkpoint too: one DeepSeek-layout layer
under `model.layers.{N}.`; its config.json names the target, which is checked.
"""

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..loop.drafters import Draft
from ..ops import rms_norm as norm_op
from ..ops.small_linear import routed_linear
from .common import additive_block_mask, block_config as _block_config, block_mask, cache_kwarg, decoder_layer_class
from .common import input_embedding, lm_head_weight, text_config
from .common import target_norm as _norm
from .drafters import _HeadDrafter, _small_linear_rows, fuses_block, head_dtype

LAYOUTS = ("deepseek", "mimo", "qwen3_next")
# (embedding norm, hidden norm, projection, final norm) key names per layout; the projection's
# input is concat(embedding, hidden) except for MiMo (hidden first).
_PARTS = {
    "deepseek": ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
    "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
    "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
}
_HIDDEN_FIRST = {"deepseek": False, "mimo": True, "qwen3_next": False}
_FEED_NORMED = {"deepseek": False, "mimo": True, "qwen3_next": True}  # what a layer returns and deeper layers read
_ZERO_FIRST = {"deepseek": True, "mimo": True, "qwen3_next": False}  # embedding zeroed at position 0 (vLLM)


def _looked_for(num_layers: int) -> str:
    return (f"model.layers.{num_layers}.eh_proj.weight (DeepSeek-V3 / GLM-4.5 layout), "
            "model.mtp_layers.0.input_proj.weight (MiMo), mtp.fc.weight (Qwen3-Next)")


# ----------------------------------------------------------------------------- checkpoint files


def checkpoint_dir_of(target) -> Path:
    """The directory `target` was loaded from: `name_or_path` when it is a local directory,
    else the Hugging Face cache's snapshot of that repository (no download). ValueError if
    neither exists."""
    name = getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None) or ""
    if name and Path(name).is_dir():
        return Path(name)
    if name:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means: not found locally
            pass
    raise ValueError(f"checkpoint_dir: the target's checkpoint directory was not found (name_or_path {name!r}); "
                     "pass checkpoint_dir= (the directory holding its *.safetensors)")


def _weight_files(folder: Path) -> Dict[str, Path]:
    """key -> safetensors file, from model.safetensors.index.json or every *.safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint_dir: {folder} holds no *.safetensors (MTP layers are read from the safetensors "
                         "files; looked for " + _looked_for(0).replace("model.layers.0.", "model.layers.{N}.") + ")")
    found = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            found.update({key: path for key in f.keys()})
    return found


def _read(files: Dict[str, Path], keys) -> Dict[str, torch.Tensor]:
    """The tensors `keys` (on the CPU), opening each file once."""
    from safetensors import safe_open

    by_file: Dict[Path, List[str]] = {}
    for key in keys:
        by_file.setdefault(files[key], []).append(key)
    out = {}
    for path, names in by_file.items():
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in names})
    return out


def find_mtp(target, checkpoint_dir=None) -> Optional[dict]:
    """What `MtpDrafter` would load for `target`, without loading it: {"layout", "prefixes"
    (one key prefix per MTP layer), "dir"}, or None when the checkpoint (default: the one the
    target was loaded from) has no MTP layers in a known layout or cannot be found."""
    try:
        folder = Path(checkpoint_dir) if checkpoint_dir is not None else checkpoint_dir_of(target)
        return _detect(target, folder, _weight_files(folder))
    except Exception:  # noqa: BLE001 - a probe (default_drafter asks it of every target): no MTP, unreadable files, no directory
        return None


def _detect(target, folder: Path, files: Dict[str, Path]) -> dict:
    """The MTP layout of a checkpoint's keys; ValueError naming what was looked for."""
    num = int(text_config(target).num_hidden_layers)
    keys = set(files)
    layout, prefixes = None, []
    if f"model.layers.{num}.eh_proj.weight" in keys:
        layout = "deepseek"
        while f"model.layers.{num + len(prefixes)}.eh_proj.weight" in keys:
            prefixes.append(f"model.layers.{num + len(prefixes)}.")
    elif "model.mtp_layers.0.input_proj.weight" in keys:
        layout = "mimo"
        while f"model.mtp_layers.{len(prefixes)}.input_proj.weight" in keys:
            prefixes.append(f"model.mtp_layers.{len(prefixes)}.")
    elif "mtp.fc.weight" in keys:
        layout = "qwen3_next"
        while any(k.startswith(f"mtp.layers.{len(prefixes)}.") for k in keys):
            prefixes.append(f"mtp.layers.{len(prefixes)}.")
        if not prefixes:
            raise ValueError(f"checkpoint_dir: {folder} has mtp.fc.weight (Qwen3-Next MTP layout) but no mtp.layers.0.* block")
    if layout is None:
        hints = sorted(k for k in keys if re.search(r"(^|\.)(mtp|nextn)", k) or re.match(r"model\.layers\.(\d+)\.", k)
                       and int(re.match(r"model\.layers\.(\d+)\.", k).group(1)) >= num)
        what = f"; it has keys in no layout we know: {', '.join(hints[:4])}{' ...' if len(hints) > 4 else ''}" if hints else ""
        raise ValueError(f"checkpoint_dir: no MTP layers in {folder} (looked for {_looked_for(num)}){what}")
    return {"layout": layout, "prefixes": prefixes, "dir": folder}


# ----------------------------------------------------------------------------- the network


class MtpLayer(nn.Module):
    """One MTP layer: norms, fused projection, a decoder block of the target's class, final
    norm; `embed` and `head` are the target's (or the layer's own copies where the
    checkpoint's differ from the target's)."""

    def __init__(self, layout: str, embed_norm: nn.Module, hidden_norm: nn.Module, proj: nn.Linear, block: nn.Module,
                 final_norm: nn.Module):
        super().__init__()
        self.layout = layout
        self.embed_norm, self.hidden_norm, self.proj, self.block, self.final_norm = (
            embed_norm, hidden_norm, proj, block, final_norm)
        self.own_embed: Optional[torch.Tensor] = None  # set when the checkpoint's copy differs from the target's
        self.own_head: Optional[torch.Tensor] = None


class MtpLayers(nn.Module):
    """The loaded MTP layers (`layers`), with what was read (`loaded_keys`, every MTP key of
    the checkpoint) and where from (`layout`, `prefixes`, `dir`)."""

    def __init__(self, layers: List[MtpLayer], layout: str, prefixes: List[str], folder: Path, loaded_keys: List[str]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.layout, self.prefixes, self.dir, self.loaded_keys = layout, prefixes, folder, loaded_keys
        self.config = {"layout": layout, "num_layers": len(layers)}


def _expert_weights(name: str, block_keys, tensors: Dict[str, torch.Tensor], prefix: str, used: set):
    """Fused expert tensors that transformers keeps as 3D parameters (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]) stacked from the checkpoint's per-expert
    linears (`experts.{e}.gate_proj.weight`, ...), as transformers' loader does; None when
    `name` is not one."""
    for fused, parts in (("experts.gate_up_proj", ("gate_proj", "up_proj")), ("experts.down_proj", ("down_proj",))):
        if not name.endswith(fused):
            continue
        base = prefix + name[: -len(fused)] + "experts."
        stacks = []
        for part in parts:
            experts = []
            while f"{base}{len(experts)}.{part}.weight" in tensors:
                key = f"{base}{len(experts)}.{part}.weight"
                experts.append(tensors[key])
                used.add(key)
            if not experts:
                return None
            stacks.append(torch.stack(experts))
        return torch.cat(stacks, dim=1)
    return None


def load_mtp(target, checkpoint_dir=None) -> MtpLayers:
    """Build and load `target`'s MTP layers from its checkpoint (see the module docstring).

    Every key under the MTP prefixes is read and used (or, for embedding / LM-head copies,
    compared with the target's); a key left over, or a block parameter the checkpoint lacks,
    raises ValueError naming it. The modules are on the target's device in its dtype, in
    eval mode."""
    folder = Path(checkpoint_dir) if checkpoint_dir is not None else checkpoint_dir_of(target)
    if not folder.is_dir():
        raise ValueError(f"checkpoint_dir: {folder} is not a directory")
    trained = folder / "config.json"
    if trained.is_file():  # a head directory of `train_draft_head(kind="mtp")` names its target
        meta = json.loads(trained.read_text())
        if meta.get("kind") == "mtp":
            from .common import check_target

            check_target(meta["target"], target, str(folder))
    files = _weight_files(folder)
    found = _detect(target, folder, files)
    layout, prefixes = found["layout"], found["prefixes"]
    top = "mtp." if layout == "qwen3_next" else None  # Qwen3-Next: norms and fc once, outside the layers
    wanted = sorted(k for k in files if any(k.startswith(p) for p in prefixes) or (top and k.startswith(top)))
    tensors = _read(files, wanted)
    cfg = text_config(target)
    hidden, eps = int(cfg.hidden_size), float(getattr(cfg, "rms_norm_eps", 1e-6))
    param = lm_head_weight(target)
    dtype, device = param.dtype, param.device
    layer_cls = decoder_layer_class(target)
    block_cfg = _block_config(target)
    e_key, h_key, p_key, f_key = _PARTS[layout]
    used = set()
    shared_final = None

    def take(key):
        if key not in tensors:
            raise ValueError(f"checkpoint_dir: {folder} lacks {key} (MTP layout {layout!r})")
        used.add(key)
        return tensors[key]

    def loaded_norm(key):
        norm = _norm(target, hidden, eps)
        norm.weight.data = take(key).to(norm.weight.dtype)  # (everything moves to the target's dtype below)
        return norm

    layers = []
    for k, prefix in enumerate(prefixes):
        own = "mtp." if layout == "qwen3_next" else prefix
        embed_norm, hidden_norm = loaded_norm(own + e_key + ".weight"), loaded_norm(own + h_key + ".weight")
        w = take(own + p_key + ".weight")
        if tuple(w.shape) != (hidden, 2 * hidden):
            raise ValueError(f"checkpoint_dir: {own + p_key}.weight has shape {tuple(w.shape)}, expected {(hidden, 2 * hidden)}")
        proj = nn.Linear(2 * hidden, hidden, bias=False)
        proj.weight.data = w
        if layout == "qwen3_next":
            if shared_final is None:
                shared_final = loaded_norm("mtp." + f_key + ".weight")
            final = shared_final
        else:
            final = loaded_norm(prefix + f_key + ".weight")
        # The block: the target's decoder layer at the index past its last (MoE models then
        # build their MoE block, as for the checkpoint's layer N + k).
        block = layer_cls(block_cfg, int(cfg.num_hidden_layers) + k)
        names = set(block.state_dict().keys())
        state = {}
        for name in names:
            key = prefix + name
            if key in tensors:
                state[name] = tensors[key]
                used.add(key)
                continue
            fused = _expert_weights(name, names, tensors, prefix, used)
            if fused is None:
                raise ValueError(f"checkpoint_dir: {folder} lacks {key} (the MTP block's {name}, layout {layout!r})")
            state[name] = fused
        expected = block.state_dict()
        for name, value in state.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(f"checkpoint_dir: MTP weight {prefix + name} has shape {tuple(value.shape)}, the "
                                 f"target's {layer_cls.__name__} expects {tuple(expected[name].shape)}")
        block.load_state_dict(state, strict=True)
        layer = MtpLayer(layout, embed_norm, hidden_norm, proj, block, final)
        # Embedding / LM-head copies (DeepSeek layout): the target's when equal, else the layer's own.
        for key, attr, mine in ((prefix + "embed_tokens.weight", "own_embed", input_embedding(target).weight),
                                (prefix + "shared_head.head.weight", "own_head", param)):
            if layout == "deepseek" and key in tensors:
                copy_ = take(key)
                if tuple(copy_.shape) != tuple(mine.shape):
                    raise ValueError(f"checkpoint_dir: {key} has shape {tuple(copy_.shape)}, the target's {tuple(mine.shape)}")
                if not torch.equal(copy_.to(mine.dtype), mine.detach().cpu()):
                    setattr(layer, attr, copy_.to(device=device, dtype=dtype))
        layers.append(layer)
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"checkpoint_dir: MTP keys this loader does not know ({layout!r} layout): {', '.join(unused[:6])}"
                         f"{' ...' if len(unused) > 6 else ''}")
    module = MtpLayers(layers, layout, prefixes, folder, wanted)
    # A trained head's directory (`train_draft_head(kind="mtp")`) also holds its draft vocabulary.
    module.draft_vocab = _read(files, ["draft_vocab"])["draft_vocab"].long() if "draft_vocab" in files else None
    return module.to(device=device, dtype=dtype).eval()


# ----------------------------------------------------------------------------- the cache


class _MtpCache:
    """The MTP layers' KV caches, one pair of buffers per layer, allocated on first write (so
    key and value head dims come from the attention itself: MLA's differ). Before each block
    forward the drafter names the layer (`active`), the slots [B, T] the new entries go to,
    and the span of slots attention reads; `update` (what transformers' attention calls)
    writes there and returns [B, H, span, D] views."""

    def __init__(self, num_layers: int, batch: int, size: int):
        self.k: List[Optional[torch.Tensor]] = [None] * num_layers
        self.v: List[Optional[torch.Tensor]] = [None] * num_layers
        self.batch, self.size = batch, size
        self.active, self.slots, self.span = 0, None, 0

    def update(self, key_states, value_states, *args, **kwargs):
        k = self.active
        if self.k[k] is None:
            b, h, _, d = key_states.shape
            self.k[k] = key_states.new_zeros(self.batch, self.size, h, d)
            self.v[k] = value_states.new_zeros(self.batch, self.size, value_states.shape[1], value_states.shape[3])
        rows = torch.arange(self.slots.shape[0], device=self.slots.device)[:, None].expand_as(self.slots)
        self.k[k][rows, self.slots] = key_states.transpose(1, 2).to(self.k[k].dtype)
        self.v[k][rows, self.slots] = value_states.transpose(1, 2).to(self.v[k].dtype)
        return self.k[k][:, : self.span].transpose(1, 2), self.v[k][:, : self.span].transpose(1, 2)

    def keep_rows(self, rows):
        self.k = [None if t is None else t[rows] for t in self.k]
        self.v = [None if t is None else t[rows] for t in self.v]
        self.batch = int(rows.numel())

    # What transformers' code may ask a cache besides update.
    def get_seq_length(self, *args, **kwargs) -> int:
        return self.span

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.span, 0


# ----------------------------------------------------------------------------- the drafter


class MtpDrafter(_HeadDrafter):
    """Draft with the target's own MTP layers (see the module docstring).

    Entry i of layer 0's cache is (target feature h_i, token i + 1), for i < lengths[b] - 1,
    caught up each step on the tokens accepted since the last (with the target's features
    that `observe` recorded); its last output drafts the root's children. Deeper nodes feed
    (their parent's layer output, their token) to the next layer under a tree mask, one
    forward per depth; the tree entries are dropped again (overwritten) next step.

    Args:
        target: the transformers causal LM whose checkpoint holds the MTP layers.
        checkpoint_dir: the directory of its safetensors (default: where the target was
            loaded from, `name_or_path`, or its snapshot in the Hugging Face cache), or a
            head directory of `train_draft_head(kind="mtp")`.
        num_tokens: a chain of k drafts (depth k, one child per node); overrides the tree
            arguments.
        max_nodes, depth, top_k, min_score: the best-first tree, as `EagleDrafter` takes
            them (same defaults: 4 nodes, depth 3, top_k 2 on a CPU; 24, 6, 6 on a GPU).
        dtype: compute dtype of the MTP layers. Default: the target's for a checkpoint's own
            layers (the drafts follow the published forward), `head_dtype` for a trained head
            (as `EagleDrafter`: bfloat16 where the device computes in it, half the weight bytes
            per depth, else float32; drafts are proposals, so outputs stay exact). A dtype other than the target's makes a converted copy of the LM-head
            rows it drafts from.
        draft_vocab: None (default): the whole vocabulary for a model's own MTP layers, and
            a trained head's own draft vocabulary (its N most frequent tokens, as EAGLE
            heads have); or a 1D tensor of token ids the drafts are restricted to. A reduced
            vocabulary keeps a copy of those LM-head rows and makes each depth's logits
            cheaper (on a small target the full-vocabulary LM head is most of the MTP
            layer's cost), at the price of never proposing the other tokens.

    On a CPU, one MTP layer whose block is a Llama / Mistral / Qwen2 / Qwen3 decoder layer (a
    trained head for such a target) runs as one `decoder_layer` op per forward
    (`_HeadDrafter._fused_tree`); other blocks (MoE, MLA, several layers) run as torch modules.

    Raises ValueError naming what was looked for when the checkpoint has no MTP layers or
    they are in a layout this loader does not know.
    """

    def __init__(self, target, checkpoint_dir=None, *, num_tokens: Optional[int] = None, max_nodes: Optional[int] = None,
                 depth: Optional[int] = None, top_k: Optional[int] = None, min_score: Optional[float] = None, dtype=None,
                 draft_vocab: Optional[torch.Tensor] = None):
        module = load_mtp(target, checkpoint_dir)
        weight = lm_head_weight(target)
        small = weight.device.type == "cpu"
        if num_tokens is not None:
            if int(num_tokens) < 1:
                raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
            max_nodes, depth, top_k = int(num_tokens), int(num_tokens), 1
        max_nodes = max_nodes if max_nodes is not None else (4 if small else 24)
        depth = depth if depth is not None else (3 if small else 6)
        top_k = top_k if top_k is not None else (2 if small else 6)
        for name, value in (("max_nodes", max_nodes), ("depth", depth), ("top_k", top_k)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if dtype is None:
            dtype = head_dtype(weight.device) if module.draft_vocab is not None else weight.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, got {dtype}")
        # (_HeadDrafter.__init__ is not called: its draft vocabulary, small-linear timing and
        # online learning belong to trained heads; these are the attributes its methods use.)
        self.dtype, self.target = dtype, target
        self.head = module.to(dtype)
        self.max_nodes, self.depth, self.top_k = int(max_nodes), int(depth), int(top_k)
        self.min_score = float(min_score) if min_score is not None else (0.25 if small else 0.0)
        if not 0.0 <= self.min_score <= 1.0:
            raise ValueError(f"min_score must be in [0, 1], got {min_score}")
        self.vocab_size = weight.shape[0]
        vocab = draft_vocab if draft_vocab is not None else module.draft_vocab
        if vocab is None:
            self.vocab = torch.arange(self.vocab_size, device=weight.device)  # the whole vocabulary
            self.w_draft = weight.detach() if weight.dtype == dtype else weight.detach().to(dtype)  # shared, no copy
        else:
            vocab = torch.as_tensor(vocab).long().flatten().to(weight.device)
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= self.vocab_size:
                raise ValueError(f"draft_vocab: expected token ids in [0, {self.vocab_size}), got {vocab.numel()} ids "
                                 f"in [{int(vocab.min()) if vocab.numel() else '-'}, {int(vocab.max()) if vocab.numel() else '-'}]")
            self.vocab, self.w_draft = vocab, weight.detach()[vocab].to(dtype)  # those rows, copied
        self.embed = input_embedding(target)
        # One layer of a Llama-family block on a CPU: the fused path (`fused_block`), with the
        # LM-head rows through our few-row kernel where measured faster.
        from ..loop.hf.lean import FAMILIES, fused_layer  # (transformers: imported when a drafter is built)

        block = module.layers[0].block
        self._fused = fused_layer(block, text_config(target)) if len(module.layers) == 1 else None
        if self._fused is not None and not fuses_block(dtype, weight.device):
            self._fused = None
        if self._fused is not None:  # the input norms, stacked in the projection's order (_block_inputs)
            layer = module.layers[0]
            norms = [layer.hidden_norm, layer.embed_norm] if _HIDDEN_FIRST[layer.layout] else [layer.embed_norm, layer.hidden_norm]
            family_norm = FAMILIES[text_config(target).model_type][4]
            norms.append(layer.final_norm)
            eps = {float(getattr(n, "variance_epsilon", getattr(n, "eps", -1.0))) for n in norms}
            if len(eps) != 1 or any(type(n).__name__ != family_norm for n in norms):
                self._fused = None
            else:  # the three norms as `rms_norm` ops: the input pair as one, then the final one
                self._pair_norm = torch.stack([n.weight.detach() for n in norms[:2]])
                self._final_norm = layer.final_norm.weight.detach()
                self._norm_eps = eps.pop()
        self.small_linear_rows = _small_linear_rows(self.head, self.w_draft) if self._fused is not None else (0, 0)
        self.feature_layers, self.with_labels, self.hidden_layers = (), False, None
        self.features = self.labels = None
        self.source, self.online = module.dir, None
        self.rotary = getattr(target.get_decoder(), "rotary_emb", None)
        if self.rotary is None:
            raise ValueError(f"target: {type(target).__name__}'s decoder has no rotary_emb to give the MTP block its positions")
        self._cache_kwarg = cache_kwarg(block)
        self._additive = additive_block_mask(target)
        self.cache = self.outs = self.cached = None

    @property
    def num_layers(self) -> int:
        """How many MTP layers the checkpoint has."""
        return len(self.head.layers)

    def save(self, out_dir):
        """MTP layers live in the target's checkpoint: nothing to save."""
        raise NotImplementedError("MtpDrafter: the MTP layers are part of the target's checkpoint; there is no head to save")

    # -- state -------------------------------------------------------------------------
    def start(self, history, lengths, capacity):
        super().start(history, lengths, capacity)
        batch = history.shape[0]
        size = capacity + max(self.depth * self.top_k, self.max_nodes) + 2  # tree nodes past the prefix
        self.cache = _MtpCache(self.num_layers, batch, size)
        hidden = self.w_draft.shape[1]
        if self._fused is not None:  # the op writes [B, S, Hkv, D] buffers; the layer's outputs are not kept
            attn = self.head.layers[0].block.self_attn
            shape = (batch, size, attn.k_proj.out_features // attn.head_dim, attn.head_dim)
            self.cache.k[0] = torch.zeros(shape, dtype=self.dtype, device=history.device)
            self.cache.v[0] = torch.zeros_like(self.cache.k[0])
            self.outs = []
        else:
            # outs[k][b, i]: what layer k returned at entry i (fed to layer k + 1, and the root's
            # children come from outs[0] at the last entry).
            self.outs = [torch.zeros(batch, size, hidden, device=history.device, dtype=self.dtype)
                         for _ in range(self.num_layers)]
        self.cached = torch.zeros(self.num_layers, batch, dtype=torch.int64, device=history.device)

    def keep_rows(self, rows):
        super().keep_rows(rows)
        self.cache.keep_rows(rows)
        self.outs = [o[rows] for o in self.outs]
        self.cached = self.cached[:, rows]

    def finish(self):
        super().finish()
        self.cache = self.outs = self.cached = None

    # -- the network -------------------------------------------------------------------
    def run_layer(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """MTP layer k on `hidden [B, T, H]` (the target's features, or a layer's outputs) and
        `tokens [B, T]` at `positions [B, T]`: writes the block's keys/values at cache
        `slots [B, T]`, attends where `mask [B, T, S]` allows (S slots from 0), and returns
        what the layer returns (fed deeper; `logits` turns it into logits)."""
        layer = self.head.layers[k]
        embeds = F.embedding(tokens, layer.own_embed) if layer.own_embed is not None else self.embed(tokens)
        embeds = embeds.to(self.dtype)
        if _ZERO_FIRST[layer.layout]:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        e, h = layer.embed_norm(embeds), layer.hidden_norm(hidden.to(self.dtype))
        x = layer.proj(torch.cat([h, e] if _HIDDEN_FIRST[layer.layout] else [e, h], dim=-1))
        self.cache.active, self.cache.slots, self.cache.span = k, slots, mask.shape[-1]
        cos_sin = self.rotary(x, positions)
        out = layer.block(x, attention_mask=block_mask(mask[:, None], self._additive, x.dtype), position_ids=positions,
                          use_cache=True,
                          position_embeddings=cos_sin, **{self._cache_kwarg: self.cache})
        x = out[0] if isinstance(out, tuple) else out
        return layer.final_norm(x) if _FEED_NORMED[layer.layout] else x

    def logits(self, k: int, out: torch.Tensor) -> torch.Tensor:
        """Logits [..., N] over the draft vocabulary (`self.vocab`, all V tokens by default) of
        layer k's output `out` (its final norm, then the LM head)."""
        layer = self.head.layers[k]
        return self._logits(out if _FEED_NORMED[layer.layout] else layer.final_norm(out), k)

    def _logits(self, g, k: int = 0):
        """Draft-vocabulary logits of layer k's normed output g (its LM head: the target's, or
        the layer's own copy where the checkpoint's differs)."""
        own = self.head.layers[k].own_head
        if own is None:
            return routed_linear(g, self.w_draft, None, self.small_linear_rows)
        return F.linear(g, own if self.vocab.numel() == self.vocab_size else own[self.vocab])

    # -- the fused block (one Llama-family layer on a CPU) --------------------------------
    def fused_block(self):
        """(weights, eps, scale) to run the MTP layer's block as one `decoder_layer` op, or None
        (see the class docstring)."""
        if not self.fuses_now():
            return None
        weights, eps = self._fused
        return weights, eps, float(self.head.layers[0].block.self_attn.scaling)

    def fuses_now(self) -> bool:
        return self._fused is not None

    def _block_inputs(self, hidden, tokens, positions):
        """proj(concat of the normed embedding and hidden state): the block's input (layer 0).
        The two RMSNorms (the target family's, one epsilon) run as one `rms_norm` op over the
        stacked pair (`fused_block` checked they qualify). positions: None where none is 0."""
        layer = self.head.layers[0]
        embeds = F.embedding(tokens, layer.own_embed) if layer.own_embed is not None else self.embed(tokens)
        embeds = embeds.to(self.dtype)
        if _ZERO_FIRST[layer.layout] and positions is not None:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        hidden = hidden.to(self.dtype)
        x = torch.stack([hidden, embeds] if _HIDDEN_FIRST[layer.layout] else [embeds, hidden], dim=-2)
        x = norm_op.rms_norm(x, self._pair_norm, self._norm_eps).flatten(-2)
        return routed_linear(x, layer.proj.weight, layer.proj.bias, self.small_linear_rows)

    def _block_outputs(self, out):
        """(fed deeper: the block's output, or its final norm for MiMo / Qwen3-Next; the final norm)."""
        normed = norm_op.rms_norm(out, self._final_norm, self._norm_eps)
        return (normed if _FEED_NORMED[self.head.layers[0].layout] else out), normed

    def _rotary(self, positions):
        return self.rotary(self.w_draft[:1], positions)  # (the module reads its input's dtype and device only)

    # -- drafting ----------------------------------------------------------------------
    def _catch_up(self, history, prefix):
        """Feed every layer the entries it lacks: layer k's index i is (layer k - 1's output
        at i, or the target's feature for k = 0; token i + 1 + k), known for i < prefix - k."""
        device = history.device
        for k in range(self.num_layers):
            end = (prefix - k).clamp(min=0)
            start = torch.minimum(self.cached[k], end)
            pending = end - start
            most = int(pending.max())
            if most > 0:
                j = torch.arange(most, device=device)
                # Past a row's end: scratch slots (>= its entries, inside the buffers).
                slots = (start[:, None] + j).clamp(max=self.cache.size - 1)
                idx = torch.minimum(slots, (end - 1).clamp(min=0)[:, None])
                source = self.features if k == 0 else self.outs[k - 1]
                hidden = source.gather(1, idx[:, :, None].expand(-1, -1, source.shape[-1]))
                tokens = history.gather(1, (idx + 1 + k).clamp(max=history.shape[1] - 1))
                span = int(slots.max()) + 1
                mask = torch.arange(span, device=device)[None, None, :] <= slots[:, :, None]
                out = self.run_layer(k, hidden, tokens, idx, slots, mask)
                real = j[None, :] < pending[:, None]
                rows = torch.arange(history.shape[0], device=device)[:, None].expand_as(slots)
                self.outs[k][rows[real], slots[real]] = out[real].to(self.dtype)
            self.cached[k] = end

    @torch.inference_mode()
    def _propose(self, history, lengths, sampling=None, budget=None) -> Draft:
        """Catch up the MTP caches, then draft a best-first tree (see the class docstring)."""
        block = self.fused_block()
        if block is not None:
            draft, self.cached[0] = self._fused_tree(history, lengths, sampling, budget, block, self.cached[0],
                                                     self.cache.k[0], self.cache.v[0])
            return draft
        device = history.device
        batch = history.shape[0]
        lengths = lengths.long()
        prefix = lengths - 1  # layer 0's entries 0 .. L-2 exist once caught up
        can_draft = prefix > 0
        self._catch_up(history, prefix)
        last = (prefix - 1).clamp(min=0)
        g_root = self.outs[0].gather(1, last[:, None, None].expand(-1, 1, self.outs[0].shape[-1]))  # [B, 1, H]
        state = {"g": g_root, "anc": torch.zeros(batch, 1, 0, dtype=torch.bool, device=device), "fed": 0, "layers": []}

        def expand(level, parent_pos, tokens):
            # The new frontier (depth `level`) feeds layer level mod K; node n sits at slot prefix + n.
            k = level % self.num_layers
            g_parent = state["g"].gather(1, parent_pos[:, :, None].expand(-1, -1, state["g"].shape[-1]))
            n_new, fed = tokens.shape[1], state["fed"]
            anc_parent = state["anc"].gather(1, parent_pos[:, :, None].expand(-1, -1, state["anc"].shape[-1]))
            own = torch.eye(n_new, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
            anc = torch.cat([anc_parent, own], dim=-1)  # [B, n_new, fed + n_new] over fed nodes
            layers = state["layers"] + [k] * n_new
            same = torch.tensor([lk == k for lk in layers], device=device)  # fed into this layer's cache
            slots = prefix[:, None] + fed + torch.arange(n_new, device=device)
            span = int(prefix.max()) + fed + n_new
            s = torch.arange(span, device=device)
            mask = (s[None, None, :] < (prefix - k)[:, None, None]).expand(-1, n_new, -1).clone()
            rel = s[None, None, :] - prefix[:, None, None]
            in_tree = (rel >= 0) & (rel < fed + n_new)
            seen = (anc & same[None, None, :]).gather(2, rel.clamp(0, fed + n_new - 1).expand(-1, n_new, -1))
            mask |= in_tree & seen
            positions = (prefix - 1 + level)[:, None].expand(-1, n_new)
            g = self.run_layer(k, g_parent, tokens, positions, slots, mask)
            state.update(g=g, anc=anc, fed=fed + n_new, layers=layers)
            return self.logits(k, g)

        first = self.logits(0, g_root[:, 0])
        return self._build(history, lengths, first, expand, sampling, budget, can_draft)
