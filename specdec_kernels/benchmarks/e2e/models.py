"""The e2e benchmark's models: the target and draft from the command line, or a Llama-3-8B-shaped
model with random weights (GPU) for the share of each step spent in our kernels."""

import re
import zlib

import torch

RANDOM_LLAMA = "llama3-8b-random"
RANDOM_DEFAULT = "smollm2-135m-random"


class WordTokenizer:
    """The random model's tokenizer when the default model, whose tokenizer it otherwise uses,
    is not installed (a GPU machine the model's parts did not reach): words and punctuation
    marks, each hashed to an id in [1, 49152) (the default tokenizer's vocabulary size, so
    prompts keep about their length in tokens; with random weights what an id means does not
    matter), and a plain chat template. Only what the e2e benchmark calls."""

    pad_token_id = 0
    eos_token_id = None
    chat_template = "<|role|>\\ncontent\\n per message, then <|assistant|>\\n"

    def __call__(self, text, return_tensors="pt", add_special_tokens=True):
        ids = [1 + zlib.crc32(w.encode()) % 49151 for w in re.findall(r"\w+|[^\w\s]", text)]
        return {"input_ids": torch.tensor([ids], dtype=torch.long)}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _random_llama(config, device, dtype):
    """A LlamaForCausalLM for `config` with random weights built in `dtype` on `device` directly
    (fp32 first would need twice the memory), in eval mode, set to run every row to
    max_new_tokens (random weights have no meaningful eos)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = config.pad_token_id
    return model.eval()


def random_llama3_8b(*, layers=None, device="cuda", dtype=torch.bfloat16, pad_token_id=None):
    """A LlamaForCausalLM with Llama-3-8B's shapes (hidden 4096, 32 query / 8 KV heads of 128,
    MLP 14336, vocab 128256) and random weights; `layers` of its 32 (default all)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=layers or 32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=pad_token_id)
    return _random_llama(config, device, dtype)


def random_default_model(*, layers=None, device="cuda", dtype=torch.bfloat16, pad_token_id=None):
    """A LlamaForCausalLM with the default model's shapes (SmolLM2-135M: hidden 576, 30 layers,
    9 query / 3 KV heads of 64, MLP 1536, vocab 49152, tied embeddings) and random weights;
    `layers` of its 30 (default all). What a step costs on a GPU, where no weights travel: a
    step's kernels and its Python do not depend on the weights' values."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None, pad_token_id=pad_token_id)
    return _random_llama(config, device, dtype)


def load_models(args, device):
    """(target, tokenizer, draft or None, label) per the command line."""
    from ...models import DEFAULT_MODEL, load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model == RANDOM_LLAMA:
        if device.type != "cuda":
            raise SystemExit(f"specdec bench e2e: --model {RANDOM_LLAMA} needs a CUDA GPU (Llama-3-8B shapes in bf16: "
                             "16 GB of weights with all 32 layers); none is visible here")
        try:
            _, tokenizer = load_model(None, verbose=False)  # prompts tokenized as for the default model (ids < 49152)
            words = ""
        except (ImportError, OSError) as error:
            print(f"default model not available for its tokenizer ({error}); prompts tokenized by WordTokenizer",
                  flush=True)
            tokenizer, words = WordTokenizer(), ", word-hash tokenizer"
        layers = args.layers
        if layers is None:
            free = torch.cuda.mem_get_info(device)[0]
            layers = 32 if free > 40e9 else max(1, int(free / 1.2e9) - 4)  # ~0.44 GB per layer + 2 GB embeddings
        model = random_llama3_8b(layers=layers, device=device, dtype=dtype or torch.bfloat16,
                                 pad_token_id=tokenizer.pad_token_id)
        label = f"{RANDOM_LLAMA} ({layers} layers, random weights{words})"
        if args.draft_model:
            print("--draft-model ignored with the random model (its vocabulary differs)", flush=True)
        return model, tokenizer, None, label
    model, tokenizer = load_model(args.model, dtype=dtype or torch.float32, device=device, verbose=True)
    draft = None
    if args.draft_model:
        draft, draft_tokenizer = load_model(None if args.draft_model == "default" else args.draft_model,
                                            dtype=dtype or torch.float32, device=device, verbose=True)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise SystemExit("specdec bench e2e: the draft model's tokenizer differs from the target's")
    return model, tokenizer, draft, args.model or DEFAULT_MODEL
