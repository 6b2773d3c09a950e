"""CPU test shim for sgl_kernel (CUDA kernels): importable, every kernel raises when called.

Never registers ``torch.ops.sgl_kernel``: SGLang probes that namespace to pick CUDA paths.
"""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel shim: {name} is a CUDA kernel, not available on CPU")

    kernel.__name__ = name
    return kernel
