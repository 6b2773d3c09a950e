"""``sgl_kernel.kvcacheio``: the same stub as the package (every kernel raises when called)."""

from sgl_kernel import __getattr__  # noqa: F401  (a module-level __getattr__ answers missing names)
