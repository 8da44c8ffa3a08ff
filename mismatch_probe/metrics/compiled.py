"""The compiled per-token loops of the metric engine (``_kernels.c``), or None.

The package builds them where a C compiler is found (``pyproject.toml``'s ``ext-modules``,
optional). Each caller keeps the numpy code the loop replaces and runs it where ``loops()`` is
None; the two give the same bits (``tests/test_metrics_compiled.py``, which also sets
``kernels`` to None to run a whole computation on numpy's calls).
"""

from __future__ import annotations

from types import ModuleType

kernels: ModuleType | None
try:
    from mismatch_probe.metrics import _kernels as kernels
except ImportError:  # built without a C compiler: numpy only
    kernels = None

COMPILED = kernels is not None


def loops(use: bool = True) -> ModuleType | None:
    """The compiled loops, where built and ``use``; None: the caller runs numpy's calls."""
    return kernels if use else None
