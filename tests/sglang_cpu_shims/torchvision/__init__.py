"""CPU test shim for torchvision (CUDA-only wheels for this torch).

SGLang imports ``torchvision.io.decode_jpeg`` at module level and transformers, seeing a torchvision
package, imports names from its submodules while building processor tables. Every submodule is an
empty stub whose attributes are inert placeholders; using one for real raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvstreams.cpu.shim"


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"torchvision shim: {cls.__qualname__} is not available in CPU tests")


def _placeholder(qualname: str):
    return _Placeholder(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
