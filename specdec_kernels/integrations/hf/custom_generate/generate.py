"""transformers' custom-generate entry point for specdec_kernels: `model.generate(...,
custom_generate=specdec_kernels.integrations.hf.CUSTOM_GENERATE_DIR, trust_remote_code=True)` runs our loop.
transformers copies this file into its module cache and calls `generate(model=..., **arguments)`.
"""

from specdec_kernels.integrations.hf import speculative_generate


def generate(model, *args, **kwargs):
    """Called by transformers with `model.generate`'s arguments; see `speculative_generate`."""
    return speculative_generate(model, *args, **kwargs)
