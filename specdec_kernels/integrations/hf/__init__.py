"""Our loop behind transformers' own `generate` call.

Two ways, both returning what `model.generate` returns by default (the sequences tensor):

    # 1. transformers' custom-generate mechanism, from the directory shipped in this package
    out = model.generate(input_ids, custom_generate=specdec_kernels.integrations.hf.CUSTOM_GENERATE_DIR,
                         trust_remote_code=True, max_new_tokens=64, drafter=sk.NgramDrafter())

    # 2. the one-line helper, with the same arguments
    out = specdec_kernels.integrations.hf.speculative_generate(model, input_ids, max_new_tokens=64)

Arguments follow `model.generate`: `inputs`/`input_ids`, `attention_mask`, `generation_config`,
`streamer` and generation-config fields as keywords (`max_new_tokens`, `do_sample`,
`temperature`, `repetition_penalty`, ...), plus ours: `drafter`, `seed`, `adaptive`. What our
loop cannot honour exactly (custom logits processors or stopping criteria, beam search,
assistant models, ...) raises ValueError naming it.
"""

from pathlib import Path

# transformers loads `<dir>/custom_generate/generate.py` for `custom_generate=<dir>`.
CUSTOM_GENERATE_DIR = str(Path(__file__).resolve().parent)

# model.generate's own arguments that have no meaning in our loop: refused unless empty.
_REFUSED = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "assistant_model",
            "negative_prompt_ids", "negative_prompt_attention_mask", "assistant_tokenizer", "tokenizer")


def speculative_generate(model, inputs=None, **kwargs):
    """`model.generate(...)` with our draft -> tree-verify -> accept loop: same arguments, same
    result (the sequences tensor [B, L + new]); greedy output identical to `model.generate`.

    See the module docstring; `specdec_kernels.loop.generate` documents `drafter`, `seed` and
    `adaptive`, and which generation-config settings are applied.
    """
    from ...loop.generate import generate

    refused = [name for name in _REFUSED if kwargs.get(name) not in (None, [], ())]
    if kwargs.get("synced_gpus"):
        refused.append("synced_gpus")
    if kwargs.get("return_dict_in_generate"):
        refused.append("return_dict_in_generate")
    if refused:
        raise ValueError(f"{', '.join(refused)}: not supported by specdec_kernels' generate loop")
    for name in _REFUSED + ("synced_gpus", "return_dict_in_generate", "use_cache", "trust_remote_code", "custom_generate"):
        kwargs.pop(name, None)
    input_ids = kwargs.pop("input_ids", None)
    if inputs is not None and input_ids is not None:
        raise ValueError("inputs, input_ids: pass the prompt once")
    input_ids = inputs if inputs is not None else input_ids
    if input_ids is None:
        raise ValueError("input_ids: the prompt token ids are required")
    if "max_new_tokens" not in kwargs:
        config = kwargs.get("generation_config") or model.generation_config
        max_new = getattr(config, "max_new_tokens", None)
        if max_new is None:
            max_length = getattr(config, "max_length", None) or 20  # HF's default max_length
            max_new = max(max_length - input_ids.shape[1], 0)
        kwargs["max_new_tokens"] = max_new
    return generate(model, input_ids, **kwargs).sequences
