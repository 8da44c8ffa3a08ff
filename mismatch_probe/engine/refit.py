"""Weights pushed into a running engine (a *refit*), and what the engine really holds after it.

An RL trainer does not restart its inference engine every step: it pushes the new weights into
the running engine, which keeps its prefix KV cache. This module is the engine side of
``probe refit`` (vLLM only, no transformers):

- ``push``: the refit itself, one entry of ``METHODS`` per way RL frameworks do it: ``reload``
  (the worker's in-place ``reload_weights`` from a path, which re-runs the weight processing),
  ``load-weights`` (``model.load_weights`` on an iterator of checkpoint-named tensors, TRL's
  colocate mode: refused where the backend packs the weights out of its reach, or where the
  tensors would have to cross a process boundary), ``sleep-wake`` (sleep, reload, wake up:
  the colocated frameworks' cycle).
- ``effective_weights``: every weight as the engine computes with it. On the CPU backend every
  linear layer's ``weight`` is emptied after loading (``torch.empty(0)``; the values live in
  packed oneDNN / SGL handles, ``vllm/model_executor/layers/utils.py``), so a linear layer's
  weight is read back as its output on an identity input (``quant_method.apply(layer,
  eye(K))``, bitwise: products with 1 and sums with 0 are exact); every other parameter and
  persistent buffer is taken as stored; the CPU backend's prepacked MoE experts are read back
  in their logical layout through the inverse of the prepack (a permutation of the elements).
- ``checkpoint_view``: a checkpoint's tensors placed where the engine's own name mapping puts
  them (``hf_to_vllm_mapper``: fused ``qkv_proj`` / ``gate_up_proj`` slices; a tied head).
- ``score_cached``: prompt log-probabilities that *read* the prefix cache as generation does
  (vLLM 0.32 skips reading it for a request with prompt log-probs unless
  ``skip_reading_prefix_cache=False``); only the positions after the request's
  ``num_cached_tokens`` are computed, so only those are returned.

Engine modes: in process every method and the iterator refits run; in a multiprocess engine
``reload`` and ``sleep-wake`` run (``collective_rpc`` with a path), the read-back sends a
callable (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set for the engine's life by
``engine_env``), and an iterator of tensors cannot cross the process boundary (refused).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mismatch_probe.errors import ProbeError

if TYPE_CHECKING:
    import torch

RELOAD, LOAD_WEIGHTS, SLEEP_WAKE = "reload", "load-weights", "sleep-wake"
METHODS = (RELOAD, LOAD_WEIGHTS, SLEEP_WAKE)
# What each engine mode can run (``supported``): an iterator of tensors stays in its process.
MODE_METHODS = {
    "in-process": (RELOAD, LOAD_WEIGHTS, SLEEP_WAKE),
    "multiprocess": (RELOAD, SLEEP_WAKE),
}
INSECURE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # apply_model's callable, multiprocess
EYE_ROWS = 1024  # identity rows per read-back call (a [1024, K] input at a time)
PERTURB_SCALE = 2.0**-6  # the negative control's change, relative to the element (or 1)


class RefitError(ProbeError):
    """The refit cannot run this way on this engine (the reason in one line)."""


# --- the refit --------------------------------------------------------------------------------


def _reload(llm: Any, path: Path) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})


def _sleep_wake(llm: Any, path: Path) -> None:
    """The colocated cycle: sleep (level 1: weights offloaded, KV cache discarded), reload,
    wake up. The CPU worker's sleep and wake-up are no-ops, but the engine core's sleep pauses
    the scheduler and clears the prefix cache (``vllm/v1/engine/core.py``: ``sleep``)."""
    llm.sleep(level=1)
    try:
        _reload(llm, path)
    finally:
        llm.wake_up()


def _load_weights(llm: Any, path: Path) -> None:
    reason = load_weights_refusal(llm)
    if reason:
        raise RefitError(f"--method load-weights: {reason}")
    llm.apply_model(partial(_load_from, str(path)))


PUSH: dict[str, Callable[[Any, Path], None]] = {
    RELOAD: _reload,
    LOAD_WEIGHTS: _load_weights,
    SLEEP_WAKE: _sleep_wake,
}


def push(llm: Any, method: str, path: Path) -> None:
    """Push the checkpoint at ``path`` into the running engine ``llm`` by ``method``.

    Raises:
        RefitError: ``method`` cannot reach the weights on this engine (why, in one line).
    """
    if method not in PUSH:
        raise RefitError(f"--method: unknown {method!r}; choose from {', '.join(METHODS)}")
    PUSH[method](llm, path)


def push_tensors(llm: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The worker's ``reload_weights`` on an iterator of checkpoint-named tensors (weight
    processing re-run, as a path reload does): in process only, the tensors are not sent."""
    if not in_process(llm):
        raise RefitError(
            "an iterator of tensors cannot cross the process boundary of a multiprocess engine"
        )
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(tensors))})


def in_process(llm: Any) -> bool:
    """True when the engine's worker runs in this process (its model reachable directly)."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    return executor is not None and hasattr(executor, "driver_worker")


def load_weights_refusal(llm: Any) -> str:
    """Why ``model.load_weights`` on an iterator cannot refit this engine ('' where it can)."""
    if not in_process(llm):
        return (
            "an iterator of tensors cannot cross the process boundary of a multiprocess "
            "engine; use --method reload"
        )
    packed = llm.apply_model(_packed_linears)[0]
    if packed:
        return (
            f"this backend packs the linear layers' weights after loading ({packed} layers "
            "emptied, their values in packed oneDNN/SGL handles), and model.load_weights "
            "writes into the emptied parameters, never into the packed values; use --method "
            "reload (the worker's reload_weights re-runs the weight processing)"
        )
    return ""


def _packed_linears(model: Any) -> int:
    return sum(1 for _, m in model.named_modules() if _is_linear(m) and m.weight.numel() == 0)


def _load_from(path: str, model: Any) -> None:
    """``model.load_weights`` on the tensors of a checkpoint directory (sent as a partial)."""
    model.load_weights(iter_checkpoint(Path(path)))


# --- effective weights ------------------------------------------------------------------------


def _is_linear(module: Any) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(module, LinearBase) and hasattr(module, "weight")


def _is_head(module: Any) -> bool:
    """An LM head: its logits come from ``quant_method.apply`` (packed on the CPU backend)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, ParallelLMHead) and hasattr(module, "quant_method")


def _linear_weight(module: Any) -> torch.Tensor:
    """``[N, K]`` the weight a linear layer computes with: its output on ``eye(K)`` (no bias)."""
    import torch

    k = int(
        getattr(module, "input_size_per_partition", 0)
        or getattr(module, "input_size", 0)  # ReplicatedLinear (an MoE router)
        or module.weight.shape[-1]
    )
    dtype = module.weight.dtype
    parts = []
    with torch.inference_mode():
        for start in range(0, k, EYE_ROWS):
            rows = min(EYE_ROWS, k - start)
            eye = torch.zeros(rows, k, dtype=dtype)
            eye[torch.arange(rows), torch.arange(start, start + rows)] = 1
            parts.append(module.quant_method.apply(module, eye, None).to(dtype))
    return torch.cat(parts).t().contiguous()


def _expert_isa(module: Any) -> str:
    """The ISA a CPU fused-experts module prepacked its weights for (``CPUUnquantizedExperts``
    and its x86, Arm and Power kinds: ``prepack_moe_weight``); '' where its experts are kept as
    loaded (another backend, or zentorch)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
        return ""
    return str(experts.isa)


@lru_cache(maxsize=4)  # every layer's experts share their shapes: found once per read-back
def _prepack_order(shape: tuple[int, ...], dtype: Any, isa: str) -> torch.Tensor | None:
    """``order`` with ``packed.view(-1) == logical.view(-1)[order]`` for the CPU experts'
    prepack (``torch.ops._C.prepack_moe_weight``), found by packing the element indices, one
    byte at a time (exact in every float dtype); None where the prepack is no permutation."""
    import torch
    from vllm._custom_ops import cpu_prepack_moe_weight

    count = 1
    for n in shape:
        count *= n
    index = torch.arange(count, dtype=torch.int64)
    order = torch.zeros(count, dtype=torch.int64)
    for byte in range((max(count - 1, 1).bit_length() + 7) // 8):
        digit = ((index >> (8 * byte)) & 255).to(dtype).reshape(shape).contiguous()
        order += cpu_prepack_moe_weight(digit, isa).reshape(-1).to(torch.int64) << (8 * byte)
    if not torch.equal(torch.sort(order).values, index):
        return None
    return order


def _unpacked(tensor: torch.Tensor, isa: str) -> torch.Tensor | None:
    """A prepacked expert tensor in its logical layout (``[E, N, K]``, as loaded)."""
    import torch

    order = _prepack_order(tuple(tensor.shape), tensor.dtype, isa)
    if order is None:
        return None
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype)
    flat[order] = tensor.detach().reshape(-1)
    return flat.reshape(tensor.shape)


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def _effective(model: Any, stored: bool = False) -> dict[str, torch.Tensor]:
    """``stored``: only the prepacked expert tensors, as stored (not unpacked)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # a tied head's weight is the embedding's: named once, as torch does
    for prefix, module in model.named_modules():
        linear = _is_linear(module) or _is_head(module)
        isa = _expert_isa(module) if hasattr(module, "w13_weight") else ""
        if stored:
            for local in EXPERT_WEIGHTS if isa else ():
                out[f"{prefix}.{local}"] = getattr(module, local).detach().cpu().clone()
            continue
        for local, tensor in module._parameters.items():
            if tensor is None:
                continue
            if id(tensor) in seen:  # a tied head: the embedding's weight, computed with apart
                if linear and local == "weight":
                    out[f"{prefix}.{local}"] = _linear_weight(module)
                continue
            seen.add(id(tensor))
            name = f"{prefix}.{local}" if prefix else local
            packed = linear and local == "weight"
            value = _linear_weight(module) if packed else tensor.detach().cpu().clone()
            if isa and local in EXPERT_WEIGHTS:  # computed with as prepacked: read unpacked
                value = _unpacked(value, isa)
                if value is None:
                    raise RefitError(f"{name}: the CPU experts' prepack ({isa}) is not a "
                                     "permutation here; the audit cannot read it back")  # fmt: skip
            out[name] = value
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for local, tensor in module._buffers.items():
            if local not in skip and tensor is not None:
                out[f"{prefix}.{local}" if prefix else local] = tensor.detach().cpu().clone()
    return out


def _effective_once(model: Any) -> dict[str, torch.Tensor]:
    try:
        return _effective(model)
    finally:
        _prepack_order.cache_clear()  # its index tensors are not kept in the worker


def effective_weights(llm: Any) -> dict[str, torch.Tensor]:
    """Every weight of the engine's model as it computes with it, by the engine's names.

    The CPU backend's fused experts (``w13_weight``, ``w2_weight``) are computed with in a
    prepacked layout (``experts.cpu_moe``: ``prepack_moe_weight``): they are read back in their
    logical ``[E, N, K]`` layout, through the inverse of that prepack (a permutation)."""
    return dict(llm.apply_model(_effective_once)[0])


def stored_experts(llm: Any) -> dict[str, torch.Tensor]:
    """The CPU backend's prepacked expert tensors as stored (empty: no such experts)."""
    return dict(llm.apply_model(partial(_effective, stored=True))[0])


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes (dtype and shape recorded beside it)."""
    data = tensor.detach().contiguous().reshape(-1).view(__import__("torch").uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


# --- a checkpoint through the engine's own name mapping -------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's files, or every one)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ProbeError(f"{path}: no safetensors weights (a refit reads safetensors)")
    return files


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of the checkpoint at ``path``, one at a time."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


@dataclass(frozen=True)
class Placement:
    """Where the engine puts one checkpoint tensor: ``engine`` name, rows ``[start, stop)``
    of its first dimension (None: the whole tensor); for a fused-experts tensor ``[E, N, K]``
    the ``expert`` (its first index; the rows and ``cols`` then index ``N`` and ``K``)."""

    engine: str
    rows: tuple[int, int] | None = None
    expert: int | None = None
    cols: tuple[int, int] | None = None

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the engine tensor this checkpoint tensor fills."""
        held = tensor if self.expert is None else tensor[self.expert]
        if self.rows is not None:
            held = held[self.rows[0] : self.rows[1]]
        if self.cols is not None:
            held = held[:, self.cols[0] : self.cols[1]]
        return held


@dataclass
class Layout:
    """The engine's name mapping, read from its model (``layout``) for a checkpoint's names:
    ``place`` a checkpoint name. Plain data, so that it crosses a process boundary."""

    placements: dict[str, Placement | None]  # checkpoint name -> its place in the engine
    tied: str = ""  # the embedding a tied head reads ('': not tied)
    head: str = ""  # a tied head's own name (it computes with the embedding apart)
    experts: bool = False  # the model has fused MoE experts (their own loader mapping)
    names: set[str] = field(default_factory=set)  # the engine's parameter names

    def place(self, name: str) -> Placement | None:
        """The engine tensor (and rows) of checkpoint tensor ``name``; None: not placed."""
        return self.placements.get(name)


def _layout_of(names: tuple[str, ...], model: Any) -> dict[str, Any]:
    """The worker side of ``layout``: the model's mapping applied to ``names`` (sent as a
    ``functools.partial``: vLLM pickles it, where a dataclass would go as a plain dict)."""
    splits: dict[str, list[int]] = {}
    experts = False
    tied = head = ""
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for prefix, module in model.named_modules():
        sizes = getattr(module, "output_partition_sizes", None)
        if _is_linear(module) and sizes and len(sizes) > 1:
            for local in ("weight", "bias"):
                if getattr(module, local, None) is not None:
                    splits[f"{prefix}.{local}"] = [int(n) for n in sizes]
        experts = experts or hasattr(module, "w13_weight")
        if tie and prefix.endswith("embed_tokens") and not tied:
            tied = f"{prefix}.weight"
        if tie and _is_head(module) and not head:
            head = f"{prefix}.weight"
    params = {n for n, _ in model.named_parameters()}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    placed = {n: _place(n, mapper, splits, tied, params) for n in names}
    for name, place in _expert_places(model).items():
        if name in placed:
            placed[name] = place
    return {"placements": placed, "tied": tied, "head": head, "experts": experts,
            "names": sorted(params)}  # fmt: skip


def _expert_places(model: Any) -> dict[str, list[Any]]:
    """Checkpoint name -> ``[engine name, start, stop, expert, col start, col stop]`` of every
    per-expert tensor, by the fused-experts modules' own loader mapping (``get_expert_mapping``:
    ``w1`` the gate rows of ``w13``, ``w3`` its up rows, ``w2`` the down projection), with the
    CPU backend's zero padding of the intermediate size left out."""
    places: dict[str, list[Any]] = {}
    for prefix, module in model.named_modules():
        mapping = getattr(module, "get_expert_mapping", None)
        if not hasattr(module, "w13_weight") or mapping is None or ".experts" not in prefix:
            continue
        base = prefix[: prefix.rfind(".experts") + 1]  # the MoE block: the mapping's names below
        config = module.moe_config
        inter = int(getattr(config, "intermediate_size_per_partition_unpadded", 0)
                    or config.intermediate_size_per_partition)  # fmt: skip
        padded = int(module.w13_weight.shape[1]) // 2
        for param, weight, expert, shard in mapping():
            local = param.rsplit(".", 1)[-1] + "weight"  # "experts.w13_" -> "w13_weight"
            engine = f"{prefix}.{local}"
            rows = {"w1": [0, inter], "w3": [padded, padded + inter]}.get(shard, [-1, -1])
            cols = [0, inter] if shard == "w2" else [-1, -1]
            places[f"{base}{weight}weight"] = [engine, *rows, int(expert), *cols]
    return places


def _place(
    name: str, mapper: Any, splits: dict[str, list[int]], tied: str, names: set[str]
) -> list[Any] | None:
    """``[engine name, start, stop]`` (start -1: the whole tensor) of a checkpoint name."""
    mapped, shard = name, None
    if mapper is not None:
        found = mapper._map_name_with_shard(name)
        if found is None:
            return None
        mapped, shard = found
    if tied and mapped.startswith("lm_head."):
        return [tied, -1, -1]
    if mapped not in names:
        return None
    sizes = splits.get(mapped)
    if shard is None or sizes is None:
        return [mapped, -1, -1]
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard) if isinstance(shard, str) else shard
    if not isinstance(index, int) or not 0 <= index < len(sizes):
        return None
    start = sum(sizes[:index])
    return [mapped, start, start + sizes[index]]


def _placement(raw: list[Any]) -> Placement:
    rows = None if raw[1] < 0 else (int(raw[1]), int(raw[2]))
    if len(raw) < 6:
        return Placement(raw[0], rows)
    cols = None if raw[4] < 0 else (int(raw[4]), int(raw[5]))
    return Placement(raw[0], rows, int(raw[3]), cols)


def layout(llm: Any, checkpoint: Path) -> Layout:
    """The engine model's name mapping (fused shards, tied head, MoE experts) for the tensor
    names of ``checkpoint``."""
    from safetensors import safe_open

    names: list[str] = []
    for file in checkpoint_files(checkpoint):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    raw = llm.apply_model(partial(_layout_of, tuple(names)))[0]
    placements = {n: None if p is None else _placement(p) for n, p in raw["placements"].items()}
    return Layout(placements, raw["tied"], raw["head"], bool(raw["experts"]), set(raw["names"]))


# --- scoring that reads the prefix cache ----------------------------------------------------


@dataclass(frozen=True)
class CachedScore:
    """One sequence scored through the prefix cache: ``logprobs[i]`` is the log-probability
    of token ``first + i`` (``first = cached + 1``: a cached position's is never computed)."""

    cached: int  # the request's num_cached_tokens
    first: int  # index of the first scored token
    logprobs: tuple[float, ...]

    def at(self) -> dict[int, float]:
        return {self.first + i: lp for i, lp in enumerate(self.logprobs)}


def score_cached(
    llm: Any, sequences: Sequence[Sequence[int]], salt: str | None = None
) -> list[CachedScore]:
    """Every sequence's prompt log-probabilities (raw, the actual token's) through the prefix
    cache: ``skip_reading_prefix_cache=False``, ``cache_salt`` when given (a salted request
    never reads blocks cached without that salt)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=0,
        detokenize=False,
        skip_reading_prefix_cache=False,
    )
    prompts = []
    for seq in sequences:
        prompt = TokensPrompt(prompt_token_ids=list(seq))
        if salt is not None:
            prompt["cache_salt"] = salt
        prompts.append(prompt)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scores = []
    for seq, out in zip(sequences, outputs, strict=True):
        cached = int(out.num_cached_tokens or 0)
        first = max(1, cached + 1)
        steps = out.prompt_logprobs
        values = tuple(float(steps[i][seq[i]].logprob) for i in range(first, len(seq)))
        scores.append(CachedScore(cached, first, values))
    return scores


def cached_block_tokens(llm: Any) -> int:
    """The engine's KV-cache block size (the prefix cache holds whole blocks)."""
    config = llm.llm_engine.vllm_config.cache_config
    return int(getattr(config, "block_size", 0) or 0)
