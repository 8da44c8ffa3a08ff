"""The sampling parameters both sides must agree on (``SamplingSpec``).

The engine side samples with them; the training side copies the engine's logit processing
(``training.logits.token_logprobs``) so that it scores the same distribution:

* ``raw``: ``log_softmax(logits)`` (vLLM ``raw_logprobs``: before temperature, top-k, top-p);
* ``processed``: vLLM's order (``v1/sample/sampler.py``): fp32 -> divide by temperature ->
  top-k (keep every logit >= the k-th largest) -> top-p (sort ascending, softmax, cumsum, mask
  where cumsum <= 1 - p, always keep the largest) -> ``log_softmax``. Greedy requests
  (temperature < 1e-5) skip all of it in the engine, so they are rescored raw.

It also flags *support flips*: positions where the top-k/top-p boundary sits so close to a
threshold that a last-bit difference between the two sides moves a token into or out of the
kept set, changing the renormalisation (a different cause than numeric drift).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LogprobsMode = Literal["processed", "raw"]
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS
VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
# The support-flip margin by dtype (the scan's and ingest's rescoring): about one unit in the
# last place of a probability near 1, so a boundary within either side's rounding error counts as
# a possible flip.
FLIP_EPS = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 8e-3}


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings shared by the rollout engine and the rescorer (all explicit)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    max_tokens: int = 96
    seed: int = 0
    logprobs_mode: LogprobsMode = "processed"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def processes_logits(self) -> bool:
        """True when the rescorer must apply temperature / top-k / top-p."""
        return self.logprobs_mode == "processed" and not self.greedy

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1.0
