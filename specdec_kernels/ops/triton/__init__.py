"""Triton kernels, used on GPU when the CUDA extension was not built.

Importing a kernel module needs `triton`; the dispatcher imports them lazily, so the package
works without it. On CPU tensors they run only under the Triton interpreter: set
`TRITON_INTERPRET=1` before the kernel module is first imported (tests do this).
"""
