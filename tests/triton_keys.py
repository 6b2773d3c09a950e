"""Which compiled variants a kernel's launches would need, read with Triton's own binder, without running them.

Why: Triton compiles a kernel once per specialisation key (its constexprs, whether each int argument is 1 or
divisible by 16, whether each pointer is 16-byte aligned). A key that follows the batch (its size, a view's offset)
means a compile, ~3 s in SGLang's scheduler on an H100, the first time each batch shape comes: a fresh server had
compiled ~65 of them through a learning run's first evaluation and steps."""

from __future__ import annotations


def record_launch_keys(monkeypatch, module, names: dict[str, str], keys: dict[str, set] | None = None
                       ) -> dict[str, set]:
    """Replace ``module``'s kernels (attribute -> label in ``names``) by recorders: each launch adds its key to
    ``keys`` (``{label: set of keys}``, returned; a new one if None) and runs nothing."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    keys = {} if keys is None else keys
    for attr, label in names.items():
        kernel = getattr(module, attr)
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)  # interpreter
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)

        def launch(*args, _binder=binder, _label=label, **kwargs):
            _, specialization, options = _binder(*args, **kwargs)
            keys.setdefault(_label, set()).add((tuple(specialization), tuple(sorted(options.items()))))

        monkeypatch.setattr(module, attr, type("Recorder", (), {"__getitem__": lambda self, grid, _l=launch: _l})())
    return keys
