"""The literal pool hypothesis draws from, pinned to a fixed import set (issue 37).

Hypothesis (6.131 and later; 6.170 here) mixes literals of the local, non-test modules imported so far into
its draws (about 1 draw in 20): every module whose file is outside site-packages and the standard library
counts, scanned again whenever `sys.modules` grows. So a derandomized test's examples depended on which of
our modules the process had imported when it drew: one node alone drew other examples than in the whole
suite, a `-k` selection or the other side of `k3num check` drew others again, and a module imported lazily
(an adapter built for the first time, an engine file loaded while a draw ran) moved unrelated tests' draws.
Hypothesis offers no public setting for the pool (none found in its docs), so the pool is pinned by what is
imported: before the first draw, the plugin imports every module of the harness (`pin`, the package `k3num`
walked, its `test_*` modules left out as hypothesis leaves them out), so the pool is the same set whatever is
selected, and no later import adds a literal of ours. The engines' files are never in it: they are executed
as modules that are not registered in `sys.modules` (engines/source.py) and no draw runs while one loads.

The pool is a function of the harness's own code (a commit), never of the engine's files or the selection.
"""

from __future__ import annotations

import importlib
import pkgutil


def pin() -> list[str]:
    """Import every module of the package `k3num` but its `test_*` modules; the names that failed to import
    (with why), which the plugin prints: nothing is silently left out of the pool."""
    import k3num

    failed = []
    for mod in pkgutil.walk_packages(k3num.__path__, prefix="k3num."):
        if mod.name.rsplit(".", 1)[-1].startswith("test_"):
            continue
        try:
            importlib.import_module(mod.name)
        except Exception as e:  # a module that cannot import here (an optional dependency): said, not hidden
            failed.append(f"{mod.name} ({type(e).__name__}: {e})")
    return failed
