"""A fake installed engine for the import-mode tests (a test double, never used by the harness).

`FakeInstall(site, engine)` lays the engine's fetched files (the released code,
byte for byte) out as an installed distribution under `site`: a
`<dist>-<version>.dist-info/METADATA` and the package files. The released
files import much of their engine (config, layers, distributed state, compiled
kernels); what the site does not hold is served by `Placeholders`, an import
finder of last resort whose modules hand out inert placeholder classes
(falsy, subclassable, subscriptable, usable as decorators). A few small shims
stand in where the bound code calls into its engine at run time: the Triton
re-export, the platform probe, and the compiled-ops module, whose ops are our
stand-ins (engines.standins).

What this proves: that the adapters bind the installed modules and files, and
report import mode. It cannot prove that the real compiled ops agree with the
oracle: that needs a CUDA machine with the engine installed (docs/gpu-run.md).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import shutil
import sys
import types
from pathlib import Path
from typing import Any

from k3num.supply import fetch


class _Placeholder(type):
    """Metaclass of the placeholder classes: attribute access, calls, `|`, `[]` give placeholders;
    a call with one class or function returns it (a decorator); every placeholder is falsy."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__name__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or isinstance(args[0], types.FunctionType)):
            return args[0]
        return placeholder(f"{cls.__name__}()")

    def __bool__(cls) -> bool:
        return False

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls) -> Any:
        return iter(())


def placeholder(name: str) -> Any:
    return _Placeholder(name.replace(".", "_").replace("()", "_call"), (), {"__module__": "k3num_fake"})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{self.__name__}.{name}")


class Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty package for any module under `tops` that no other finder found."""

    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.tops:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _PlaceholderModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


# shim modules: relative path -> source; each falls back to placeholders for other names (PEP 562)
_FALLBACK = "from tests.fake_install import placeholder as _p\ndef __getattr__(name):\n    return _p(name)\n"
SHIMS: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm/triton_utils.py": "import triton\nimport triton.language as tl\n",
        "vllm/platforms.py": (
            "class _Platform:\n"
            "    def is_device_capability_family(self, family):\n        return False\n"
            "    def is_arch_support_pdl(self):\n        return False\n"
            "current_platform = _Platform()\n" + _FALLBACK),
        # the compiled ops of this fake are the harness's stand-ins (engines.standins)
        "vllm/_custom_ops.py": (
            "from engines import standins\n"
            "def rms_norm(out, input, weight, epsilon):\n    standins.rms_norm_into(out, input, weight, epsilon)\n"
            "def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):\n"
            "    from k3num.engines.vllm_adapter.context_kv import _rotary_embedding\n"
            "    _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)\n"
            "def concat_and_cache_mla_grouped(*args):\n"
            "    raise NotImplementedError('the fake install writes no caches')\n" + _FALLBACK),
        # the Eagle mixin whose method the ROCm tap calls through super(): the harness's stand-in
        "vllm/model_executor/models/interfaces.py": (
            "from k3num.engines.vllm_adapter.aux_capture import _mixin_maybe_add_hidden_state\n"
            "class EagleModelMixin:\n    _maybe_add_hidden_state = _mixin_maybe_add_hidden_state\n" + _FALLBACK),
    },
    "sglang": {
        "sglang/srt/utils/__init__.py": (
            "import torch\n"
            "def is_cuda():\n    return torch.cuda.is_available()\n"
            "def is_hip():\n    return False\n"
            "def is_npu():\n    return False\n" + _FALLBACK),
    },
    "tokenspeed": {
        # the package's entry point, on this machine: the pinned Triton apply_k_rope as source mode loads it
        # (the real __init__ imports the registry, which a fake install cannot serve)
        "tokenspeed_kernel/ops/embedding/__init__.py": (
            "import functools\n"
            "@functools.cache\n"
            "def _kernels():\n"
            "    from k3num.engines.tokenspeed_adapter import kernels as tokenspeed_kernels\n"
            "    from k3num.supply import fetch\n"
            "    return tokenspeed_kernels.load(fetch.cache_root() / 'tokenspeed-0.1.1', True, want_cuda_rope=False)\n"
            "def apply_k_rope(positions, k, head_size, cos_sin_cache, *, is_neox=True, **kw):\n"
            "    return _kernels().apply_k_rope(positions, k, head_size, cos_sin_cache, is_neox=is_neox, **kw)\n"
            + _FALLBACK),
    },
}
# top-level packages whose missing modules become placeholders
TOPS = {"vllm": {"vllm"}, "sglang": {"sglang", "sgl_kernel"}, "tokenspeed": {"tokenspeed", "tokenspeed_kernel"}}


# pinned files that only source mode uses (lifted functions and classes: the PP relay, the
# quantized loaders): they import deep into the engine, which this fake serves with placeholders,
# so they stay out of the fake site (a real install has them, with their real imports)
LIFTED_ONLY: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm/v1/worker/gpu/pp_utils.py", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
             "vllm/model_executor/layers/linear.py", "vllm/model_executor/parameter.py",
             "vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_w4a4_nvfp4.py",
             "vllm/model_executor/layers/quantization/modelopt.py"),
}


class FakeInstall:
    """`engine` (a PINS key) installed under `site` at `version` (default: the pin's)."""

    def __init__(self, site: Path, engine: str, version: str | None = None,
                 overrides: dict[str, str] | None = None) -> None:
        pin = fetch.PINS[engine]
        self.site, self.engine, self.version = site, engine, version or pin.version
        cache = fetch.cache_root() / f"{pin.engine}-{pin.version}"
        for rel in pin.files:
            if rel in LIFTED_ONLY.get(engine, ()):
                continue
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cache / rel, dst)
        for rel, text in {**SHIMS[engine], **(overrides or {})}.items():
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
        info = site / f"{pin.dist}-{self.version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pin.dist}\nVersion: {self.version}\n")
        self.finder = Placeholders(TOPS[engine])

    def activate(self, monkeypatch: Any) -> None:
        """Put the site first on sys.path and the placeholder finder last on sys.meta_path; the
        `installed_modules` fixture (tests/test_import_mode.py) removes what was imported."""
        monkeypatch.syspath_prepend(str(self.site))
        monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, self.finder])
