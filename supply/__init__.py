"""Where engine code comes from: the pinned wheels and sdist (`fetch`), vLLM's CUDA ops built from
it (`cuda_ops`), and the installed engine (`installed`, import mode). Below the adapters: nothing
here imports `k3num.engines`.

`EngineUnavailable` is the one error an engine that cannot be had here raises (missing files,
a wheel that is not the pinned one, import mode required but not possible); the engines' tests
skip with its message.
"""


class EngineUnavailable(RuntimeError):
    """An engine cannot be built here (missing source, wrong version, ...)."""
