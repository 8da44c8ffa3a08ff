"""Restricted unpickling of the pickle-based framework dumps (verl ``.dp``, SkyRL ``.pkl``).

Those dumps are ``pickle.dump`` of a framework object. Plain ``pickle.load`` would import the
framework (verl, tensordict, SkyRL) and call whatever the file names: a pickle can run any
code. ``load`` never imports a module the file names. ``find_class`` answers, in order:

* the reader's stand-ins: the framework's classes and rebuild functions by module and name,
  mapped to small objects of ours that only keep the pickled state (``Captured``) or decode it;
* a fixed whitelist: numpy's array, dtype and scalar reconstruction, torch's tensor rebuild
  functions (storages come from torch's own loader), dtypes, ``torch.Size``,
  ``torch.device``, ``collections.OrderedDict`` and a few builtin containers;
* anything else is refused, naming the global (``os.system`` in a crafted file never runs).

Tensors that the framework wrote with ``torch.save`` inside its pickle (verl's TensorDict
buffer, SkyRL's bfloat16 fallback), and slime's ``.pt`` dumps, go through the same unpickler
(``torch.load`` with our ``pickle_module``) or ``torch.load(weights_only=True)``. A zip that
looks like a TorchScript archive is refused before ``torch.load`` sees it: ``torch.load``
hands such an archive to ``torch.jit.load``, which ignores ``pickle_module`` and runs the
archive's code (a scripted ``__setstate__``). A whitelist is not a sandbox: the
whitelisted reconstructors still run on bytes from the file, and a bug in them or in pickle
could be exploited. So the readers refuse to open these files at all without
``--trust-pickle``.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mismatch_probe.errors import ProbeError
from mismatch_probe.ingest.hook import to_numpy

StandIns = Mapping[tuple[str, str], Any]

TRUST_HINT = "unpickling can run code from the file: pass --trust-pickle if you trust it"


def refuse_untrusted(path: Path, what: str, trust_pickle: bool) -> None:
    """One line naming ``--trust-pickle`` unless the user gave it."""
    if not trust_pickle:
        raise ProbeError(f"{path}: {what} are Python pickles and {TRUST_HINT}")


class Captured:
    """An object of a framework class rebuilt without the framework: its constructor
    arguments and its pickled state (``__setstate__``), nothing run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class CapturedDict(dict):  # type: ignore[type-arg]
    """A framework ``dict`` subclass rebuilt as a plain dict plus its pickled state."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _module(name: str) -> Any:
    return importlib.import_module(name)  # our own fixed names only, never the file's


def _numpy_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    try:
        multiarray, numeric = _module("numpy._core.multiarray"), _module("numpy._core.numeric")
    except ImportError:  # numpy < 2
        multiarray, numeric = _module("numpy.core.multiarray"), _module("numpy.core.numeric")
    out: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    for package in ("numpy.core", "numpy._core"):
        out[(f"{package}.multiarray", "_reconstruct")] = multiarray._reconstruct
        out[(f"{package}.multiarray", "scalar")] = multiarray.scalar
        out[(f"{package}.numeric", "_frombuffer")] = numeric._frombuffer
    for name in dir(_module("numpy.dtypes")):  # numpy 2 pickles dtypes by their class
        if name.endswith("DType"):
            out[("numpy.dtypes", name)] = getattr(_module("numpy.dtypes"), name)
    return out


def _load_storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (a tensor pickled without ``torch.save``), loaded
    weights-only."""
    import torch

    refuse_torchscript(data)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _torch_globals() -> dict[tuple[str, str], Any]:
    import collections

    import torch

    utils = torch._utils
    out: dict[tuple[str, str], Any] = {
        ("torch._utils", name): getattr(utils, name)
        for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3")
        if hasattr(utils, name)
    }
    out[("torch", "Size")] = torch.Size
    out[("torch", "device")] = torch.device
    out[("torch.storage", "_load_from_bytes")] = _load_storage_from_bytes
    out[("collections", "OrderedDict")] = collections.OrderedDict
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            out[("torch", name)] = getattr(torch, name)
    return out


def _builtin_globals() -> dict[tuple[str, str], Any]:
    import builtins
    import codecs

    out: dict[tuple[str, str], Any] = {}
    for module in ("builtins", "__builtin__"):
        for name in ("set", "frozenset", "bytearray", "bytes", "complex", "slice", "range"):
            out[(module, name)] = getattr(builtins, name)
    out[("_codecs", "encode")] = codecs.encode  # bytes in protocol-2 pickles
    return out


_WHITELIST: dict[tuple[str, str], Any] = {}


def whitelist() -> dict[tuple[str, str], Any]:
    if not _WHITELIST:
        _WHITELIST.update(_numpy_globals())
        _WHITELIST.update(_torch_globals())
        _WHITELIST.update(_builtin_globals())
    return _WHITELIST


class Refused(pickle.UnpicklingError):
    """A global outside the stand-ins and the whitelist."""


def restricted_unpickler(stand_ins: StandIns) -> type[pickle.Unpickler]:
    """A ``pickle.Unpickler`` class resolving globals as the module docstring says."""

    class RestrictedUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            key = (module, name)
            if key in stand_ins:
                return stand_ins[key]
            allowed = whitelist()
            if key in allowed:
                return allowed[key]
            raise Refused(f"{module}.{name}")

    return RestrictedUnpickler


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` and ``load``."""

    __name__ = "mismatch_probe_restricted_pickle"

    def __init__(self, stand_ins: StandIns) -> None:
        self.Unpickler = restricted_unpickler(stand_ins)

    def load(self, file: BinaryIO, **kwargs: Any) -> Any:
        return self.Unpickler(file, **kwargs).load()


class TorchScriptRefused(pickle.UnpicklingError):
    """A TorchScript archive where a ``torch.save`` file was expected."""


def refuse_torchscript(source: bytes | Path) -> None:
    """Raise ``TorchScriptRefused`` when ``source`` (bytes or a file) is a zip that
    ``torch.load`` would dispatch to ``torch.jit.load`` (whose code would run on loading)."""
    if isinstance(source, Path):
        with source.open("rb") as fh:
            found = _is_torchscript(fh)
    else:
        found = _is_torchscript(io.BytesIO(source))
    if found:
        raise TorchScriptRefused("a TorchScript archive")


def torchscript_message(path: Path) -> str:
    return (
        f"{path}: a TorchScript archive where a torch.save file belongs; probe does not load "
        "it (torch.load would run the archive's code)"
    )


def _is_torchscript(fh: BinaryIO) -> bool:
    """torch's own test (``torch.serialization``: a zip whose records hold ``constants.pkl``),
    so what is refused is exactly what ``torch.load`` would hand to ``torch.jit.load``; names
    read with ``zipfile`` where torch's private helpers are gone."""
    import zipfile

    import torch.serialization as ts

    try:
        if not ts._is_zipfile(fh):
            return False
        fh.seek(0)
        with ts._open_zipfile_reader(fh) as archive:
            return bool(ts._is_torchscript_zip(archive))
    except AttributeError:  # a torch without these helpers
        fh.seek(0)
        if not zipfile.is_zipfile(fh):
            return False
        names = zipfile.ZipFile(fh).namelist()
        return any(n.split("/", 1)[-1] == "constants.pkl" for n in names)
    except RuntimeError:  # not a readable zip: torch.load fails on it the same way, later
        return False
    finally:
        fh.seek(0)


def torch_load(source: bytes | Path, stand_ins: StandIns) -> Any:
    """``torch.load`` of bytes or a file written by ``torch.save``, globals resolved by our
    unpickler; a TorchScript archive is refused before loading (see the module docstring)."""
    import torch

    refuse_torchscript(source)
    return torch.load(
        io.BytesIO(source) if isinstance(source, bytes) else source,
        map_location="cpu",
        weights_only=False,
        pickle_module=_PickleModule(stand_ins),  # type: ignore[arg-type]
    )


class CapturedModules(Mapping[tuple[str, str], Any]):
    """Stand-ins for every class of the named packages (``slime``, ``miles``): each is rebuilt
    as a ``Captured`` (its arguments and state kept, nothing of the package imported or run)."""

    def __init__(self, *packages: str) -> None:
        self.packages = packages

    def __getitem__(self, key: tuple[str, str]) -> Any:
        if key not in self:
            raise KeyError(key)
        return Captured

    def __contains__(self, key: object) -> bool:
        return (
            isinstance(key, tuple)
            and len(key) == 2
            and any(key[0] == p or str(key[0]).startswith(p + ".") for p in self.packages)
        )

    def __iter__(self) -> Any:
        return iter(())

    def __len__(self) -> int:
        return 0


def load(path: Path, stand_ins: StandIns, what: str) -> Any:
    """Unpickle ``path`` with the stand-ins; every failure is one ``ProbeError`` line."""
    return guarded(path, what, lambda: _load_file(path, stand_ins))


def _load_file(path: Path, stand_ins: StandIns) -> Any:
    with path.open("rb") as fh:
        return restricted_unpickler(stand_ins)(fh).load()


def guarded(path: Path, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, its failures on a bad file turned into one line naming ``path``."""
    try:
        return fn()
    except ProbeError:
        raise
    except Refused as exc:
        raise ProbeError(
            f"{path}: the pickle needs {exc.args[0]}, which probe does not load (it rebuilds "
            f"only numpy arrays, torch tensors and the {what} containers it knows)"
        ) from None
    except TorchScriptRefused:
        raise ProbeError(torchscript_message(path)) from None
    except OSError as exc:
        raise ProbeError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except Exception as exc:  # a malformed pickle fails in any of pickle's or numpy's ways
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise ProbeError(f"{path}: not a readable {what} pickle ({reason})") from None


def batch_matrix(
    batch: Mapping[str, Any], key: str, file: Path, dtype: Any, why: str = ""
) -> np.ndarray:
    """``batch[key]`` (a tensor or array of a framework's batch) as a ``[rows, tokens]`` numpy
    array of ``dtype``; one line naming ``file`` (and ``why``) when it is missing or not 2-D."""
    if batch.get(key) is None:
        raise ProbeError(f"{file}: the batch has no {key!r}{why}")
    value = to_numpy(batch[key], dtype)
    if value.ndim != 2:
        raise ProbeError(f"{file}: {key} has shape {value.shape}, expected [batch, tokens]")
    return value
