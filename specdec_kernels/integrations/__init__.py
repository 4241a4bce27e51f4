"""Adapters that put our loop and drafters inside other libraries: `hf` (our loop behind
transformers' `model.generate`) and `vllm` (our drafters as a vLLM proposer). Each imports its
library only when used; importing `specdec_kernels` imports none of them.
"""
