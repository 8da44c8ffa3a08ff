"""Seeded requests through a partial (chunked) prefill, on a generator without an offset.

Each request of a scan has its own seed (``rollout.request_seed``): the same settings give the
same tokens. When a step's token budget ends inside a prompt, vLLM prefills that prompt in
chunks; the step still samples a token for the request, throws it away, and rewinds the
request's generator by the draws the sample took (``GPUModelRunner._bookkeeping_sync``:
``gen.set_offset(gen.get_offset() - 4)``, Philox on a GPU). A CPU generator (Mersenne Twister)
has no offset: ``RuntimeError: CPU Generator does not use offset``, and every GRPO-sized group
(16 prompts x 8 samples) of real prompts hits it.

``install`` patches vLLM's model runner in the process the worker runs in (this one for an
in-process engine; ``SeededGenerators``, named as the worker extension, imports this module in
an engine's own worker process): the state of every CPU generator whose sample the step will
discard is saved before sampling and put back right after, so the discarded sample leaves no
trace (the request's next sample draws what it would have drawn without the partial prefill,
which is what vLLM's rewind does for Philox), and vLLM's rewind skips those generators. A GPU
generator is left to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MARK = "_mismatch_probe_seeded"
EXTENSION = f"{__name__}.SeededGenerators"  # vLLM's ``worker_extension_cls``


def install() -> bool:
    """Patch vLLM's GPU (and so CPU) model runner once per process; True when it is patched
    (False: an installed vLLM without the methods this relies on, left as it is)."""
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    if getattr(cls, _MARK, False):
        return True
    sample, bookkeeping = getattr(cls, "_sample", None), getattr(cls, "_bookkeeping_sync", None)
    if sample is None or bookkeeping is None:
        return False
    cls._sample = _restoring(sample)  # type: ignore[method-assign]
    cls._bookkeeping_sync = _hiding(bookkeeping)  # type: ignore[method-assign]
    setattr(cls, _MARK, True)
    return True


def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Batch index -> CPU generator of each request whose sampled token this step discards
    (a partial prefill)."""
    batch = runner.input_batch
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    return {
        int(i): gen
        for i in mask.nonzero()[0]
        if (gen := batch.generators.get(int(i))) is not None and gen.device.type == "cpu"
    }


def _restoring(sample: Callable[..., Any]) -> Callable[..., Any]:
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: (g, g.get_state()) for i, g in discarded_cpu_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for gen, state in saved.values():
                gen.set_state(state)

    return _sample


def _hiding(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        hidden = discarded_cpu_generators(self)  # already restored: vLLM's rewind is not theirs
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    return _bookkeeping_sync


class SeededGenerators:
    """vLLM's ``worker_extension_cls`` for an engine's own worker process: importing this
    module there installs the patch (no methods: nothing to conflict with the worker's)."""


install()
