"""``probe refit --from A --to B``: push B into an engine running A, audit it, measure the links.

One engine starts on checkpoint A and runs the prompts (its prefix cache fills, as a training
step's rollouts fill it); B's weights are pushed into that running engine (``--method``,
``engine.refit.push``). Then, on that engine: the weights it holds read back
(``engine.refit.effective_weights``), the same tokens scored through the prefix cache still warm
from A, with a ``cache_salt`` of B's weight version, and after ``reset_prefix_cache``; the
negative control (a second refit through the same path, one tensor of B perturbed). A second
engine starts fresh on B: its weights and the same scoring. Last, the transformers forward on B.

``refit.json`` (``store.REFIT_FILE``) holds ``audit`` (the refitted engine against the fresh one
and against B's checkpoint through the engine's name mapping; the negative control) and
``links`` (``stale_prefix_cache``: warm vs reset, ``refit``: reset vs fresh, ``engine_vs_train``:
fresh vs transformers, ``cache_salt``: salted vs reset), each over the positions both sides
scored (a scoring through the cache computes only the positions after its cached tokens).

Precision settings as in ``probe scan`` (comma lists): each rollout setting runs the two engines,
each training dtype its forward; one result per setting (``refit.json`` is the result itself, or
``settings``: the list). The stages are named for an interrupt's message (``engine start``,
``generation``, ``refit``, ``weight audit``, ``scoring``, ``negative control``, ``fresh engine``,
``training``, ``writing``); each engine stops on the way out whatever happens, and
``refit.json`` is written once every measurement is done (nothing before it).
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mismatch_probe import interrupt, models, store
from mismatch_probe.engine import audit, process, refit, rollout
from mismatch_probe.errors import ProbeError
from mismatch_probe.metrics import links
from mismatch_probe.models.checkpoint import check_weights
from mismatch_probe.prompts import Prompt, encode_prompts, load_prompts
from mismatch_probe.report.refit import write_refit_reports
from mismatch_probe.rundir.refit import refit_settings
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import (
    DTYPES,
    KV_CACHE_DTYPES,
    RolloutSetting,
    Setting,
    rollout_settings,
    split_list,
)

REFIT_PROMPTS = Path(__file__).resolve().parent.parent.parent / "prompts" / "refit.jsonl"
LINKS = {  # name -> (lower side, upper side)
    "stale_prefix_cache": ("warm", "reset"),
    "refit": ("reset", "fresh"),
    "engine_vs_train": ("fresh", "train"),
    "cache_salt": ("salted", "reset"),
}
# Push: (engine, checkpoint path) -> None; the method's own unless a caller gives another.
Push = Callable[[Any, Path], None]


@dataclass(frozen=True)
class RefitConfig:
    """Every option of ``probe refit``, checked by ``check``."""

    from_ckpt: Path
    to_ckpt: Path
    out: Path
    method: str = refit.RELOAD
    prompts: Path | None = None
    num_prompts: int | None = None
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int = 0
    rollout_dtype: str = "float32"
    train_dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    chat: bool | None = None
    vllm_args: dict[str, Any] = field(default_factory=dict)
    force: bool = False
    verbose: bool = False

    def check(self) -> None:
        """Paths and values, before vLLM or transformers is imported.

        Raises:
            ProbeError: an unknown method, a missing checkpoint or one without safetensors,
                an occupied or unwritable ``--out``.
        """
        if self.method not in refit.METHODS:
            raise ProbeError(f"--method: unknown {self.method!r}; choose from "
                             f"{', '.join(refit.METHODS)}")  # fmt: skip
        for option, path in (("--from", self.from_ckpt), ("--to", self.to_ckpt)):
            if not path.is_dir():
                raise ProbeError(f"{option} {path}: not a checkpoint directory")
            check_weights(path)
            refit.checkpoint_files(path)
        if (self.out / store.REFIT_FILE).exists() and not self.force:
            raise ProbeError(f"--out {self.out} holds a refit run already ({store.REFIT_FILE}); "
                             "choose another directory, or give --force")  # fmt: skip
        store.check_writable(self.out, "--out")
        for option, values, allowed in (
            ("--rollout-dtype", self.rollout_dtypes(), DTYPES),
            ("--train-dtype", self.train_dtypes(), DTYPES),
            ("--kv-cache-dtype", self.kv_cache_dtypes(), KV_CACHE_DTYPES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ProbeError(f"{option}: {', '.join(bad) or 'no value'}: choose from "
                                 f"{', '.join(allowed)} (a comma list runs each)")  # fmt: skip

    def rollout_dtypes(self) -> tuple[str, ...]:
        return split_list(self.rollout_dtype, "--rollout-dtype")

    def train_dtypes(self) -> tuple[str, ...]:
        return split_list(self.train_dtype, "--train-dtype")

    def kv_cache_dtypes(self) -> tuple[str, ...]:
        return split_list(self.kv_cache_dtype, "--kv-cache-dtype") or ("auto",)

    def rollout_settings(self) -> list[RolloutSetting]:
        """Every rollout setting, in the order given (the cross product, as in probe scan)."""
        return rollout_settings(self.rollout_dtypes(), self.kv_cache_dtypes())


@dataclass
class Side:
    """One scoring of the sequences: per sequence ``{token index: log-prob}`` and cached."""

    scores: list[dict[int, float]]
    cached: list[int]

    @classmethod
    def of(cls, scored: Sequence[refit.CachedScore]) -> Side:
        return cls([s.at() for s in scored], [s.cached for s in scored])


@dataclass
class Fresh:
    """What a fresh engine on B gave: its weights and its scoring of ``sequences``."""

    sequences: list[list[int]]
    weights: dict[str, Any]
    side: Side
    setting: str = RolloutSetting("float32").name  # the rollout setting it ran under


@dataclass
class RefitResult:
    """What ``run_refit`` measured (``data`` is refit.json), and the fresh side for reuse."""

    data: dict[str, Any]
    path: Path
    fresh: Fresh


def weight_version(path: Path) -> str:
    """A checkpoint's weight version: SHA-256 of its safetensors files' bytes (the salt)."""
    digest = hashlib.sha256()
    for file in refit.checkpoint_files(path):
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _prompts(cfg: RefitConfig) -> list[Prompt]:
    return load_prompts((cfg.prompts or REFIT_PROMPTS).resolve(), cfg.num_prompts)


def _engine_kwargs(
    cfg: RefitConfig, setting: RolloutSetting, model: Path, max_len: int
) -> dict[str, Any]:
    spec = SamplingSpec(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
    rollout.check_supported(setting)
    extra = {"enable_prefix_caching": True, **cfg.vllm_args}
    return rollout.engine_kwargs(model, setting, spec, max_len, extra)


@contextmanager
def _engine(kwargs: dict[str, Any], method: str) -> Iterator[Any]:
    env = rollout.engine_env(kwargs=kwargs)
    mode = rollout.engine_mode(env)
    if method not in refit.MODE_METHODS[mode]:
        raise refit.RefitError(
            f"--method {method}: a {mode} engine cannot run it (an iterator of tensors "
            "cannot cross the process boundary); use --method reload"
        )
    if mode == rollout.MULTIPROCESS:
        env = {**env, **refit.INSECURE_ENV}  # apply_model sends a callable to the worker
    with rollout.engine(kwargs, env) as llm:
        yield llm


@dataclass
class EngineSide:
    """What the engines of one rollout setting gave: the refitted engine's scorings and weights,
    the negative control's weights, the fresh engine on B."""

    sequences: list[list[int]]
    block: int
    layout: refit.Layout
    refitted: dict[str, Any]
    stored: dict[str, Any]
    sides: dict[str, Side]
    control: str
    perturbed: dict[str, Any]
    fresh: Fresh
    timings: dict[str, float]
    mode: str  # the refitted engine's: in-process or multiprocess


def _engines(
    cfg: RefitConfig,
    setting: RolloutSetting,
    encoded: list[Any],
    max_len: int,
    do_push: Push,
    fresh: Fresh | None,
    tmp: Path,
    refuse_load_weights: bool,
) -> EngineSide:
    """One rollout setting: the engine on A, the refit, its read-back and scorings, the negative
    control; then a fresh engine on B (unless ``fresh`` already holds it). Each engine is
    stopped on the way out, whatever happens (an error, an interrupt)."""
    spec = SamplingSpec(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
    salt = f"weights-{weight_version(cfg.to_ckpt)}"
    timings: dict[str, float] = {}
    mark = time.perf_counter()
    kwargs_a = _engine_kwargs(cfg, setting, cfg.from_ckpt, max_len)
    mode = rollout.engine_mode(rollout.engine_env(kwargs=kwargs_a))
    with interrupt.stage("engine_start"), _engine(kwargs_a, cfg.method) as llm:
        if refuse_load_weights:
            reason = refit.load_weights_refusal(llm)
            if reason:
                raise refit.RefitError(f"--method load-weights: {reason}")
        with interrupt.stage("generation"):
            rollouts = rollout.generate(llm, encoded, spec, 1)
        sequences = [[*r.prompt_ids, *r.response_ids] for r in rollouts]
        block = refit.cached_block_tokens(llm)
        layout = refit.layout(llm, cfg.to_ckpt)
        with interrupt.stage("refit"):
            push_start = time.perf_counter()
            do_push(llm, cfg.to_ckpt)
            timings["push"] = time.perf_counter() - push_start
        with interrupt.stage("weight_audit"):
            refitted = refit.effective_weights(llm)
            stored = refit.stored_experts(llm)
        with interrupt.stage("scoring"):
            warm = Side.of(refit.score_cached(llm, sequences))
            salted = Side.of(refit.score_cached(llm, sequences, salt=salt))
            llm.reset_prefix_cache()
            reset = Side.of(refit.score_cached(llm, sequences))
        with interrupt.stage("negative_control"):
            control = audit.control_tensor(layout, cfg.to_ckpt)
            perturbed: dict[str, Any] = {}
            if control:
                copy = audit.perturbed_copy(cfg.to_ckpt, control, tmp / f"perturbed-{setting.name}")
                do_push(llm, copy)
                perturbed = refit.effective_weights(llm)
    timings["refitted_engine"] = time.perf_counter() - mark
    reuse = fresh is not None and fresh.sequences == sequences and fresh.setting == setting.name
    if fresh is None or not reuse:
        mark = time.perf_counter()
        kwargs_b = _engine_kwargs(cfg, setting, cfg.to_ckpt, max_len)
        with interrupt.stage("fresh_engine"), _engine(kwargs_b, refit.RELOAD) as llm_b:
            fresh = Fresh(sequences, refit.effective_weights(llm_b),
                          Side.of(refit.score_cached(llm_b, sequences)), setting.name)  # fmt: skip
        timings["fresh_engine"] = time.perf_counter() - mark
    sides = {"warm": warm, "salted": salted, "reset": reset, "fresh": fresh.side}
    return EngineSide(sequences, block, layout, refitted, stored, sides, control, perturbed,
                      fresh, timings, mode)  # fmt: skip


def run_refit(
    cfg: RefitConfig, console: Any, push: Push | None = None, fresh: Fresh | None = None
) -> RefitResult:
    """The whole refit measurement (module docstring); writes ``refit.json`` into ``cfg.out``.

    One result per setting, as in ``probe scan``: every rollout setting (``--rollout-dtype`` x
    ``--kv-cache-dtype``) runs its own engines, every ``--train-dtype`` its own transformers
    forward. With one setting ``refit.json`` is that setting's result; with more it holds them
    under ``settings`` (``rundir.refit.refit_settings`` reads both).

    Args:
        push: how B reaches the running engine (default: ``cfg.method``'s); a test's wrong refit.
        fresh: a fresh engine's side on the same B, setting and sequences (not started again).

    Raises:
        ProbeError: bad input; ``refit.RefitError``: the method cannot run on this engine
            (every engine is stopped first).
    """
    cfg.check()
    started = time.time()
    with process.importing():
        from transformers import AutoTokenizer

        process.import_vllm_quietly(cfg.verbose)
    interrupt.writing_to(cfg.out, started)
    for setting in cfg.rollout_settings():
        rollout.check_supported(setting)  # every setting, before the first engine starts
    tokenizer = AutoTokenizer.from_pretrained(cfg.from_ckpt, local_files_only=True)
    chat = bool(getattr(tokenizer, "chat_template", None)) if cfg.chat is None else cfg.chat
    context = int(getattr(tokenizer, "model_max_length", 1 << 20))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.from_ckpt, local_files_only=True)
    context = min(context, int(getattr(config, "max_position_embeddings", context)))
    encoded = encode_prompts(_prompts(cfg), tokenizer, chat, context, cfg.max_tokens)
    max_len = min(context, max(len(p.token_ids) for p in encoded) + cfg.max_tokens + 1)
    do_push = push or (lambda llm, path: refit.push(llm, cfg.method, path))
    version = weight_version(cfg.to_ckpt)
    results: list[dict[str, Any]] = []
    with _output(cfg), tempfile.TemporaryDirectory(prefix="probe-refit-") as tmp:
        for setting in cfg.rollout_settings():
            refuse = cfg.method == refit.LOAD_WEIGHTS and push is None
            part = _engines(cfg, setting, encoded, max_len, do_push, fresh, Path(tmp), refuse)
            fresh = part.fresh
            for train_dtype in cfg.train_dtypes():
                mark = time.perf_counter()
                with interrupt.stage("training"):
                    train = _train_side(cfg.to_ckpt, train_dtype, part.sequences)
                timings = {**part.timings, "training": time.perf_counter() - mark}
                results.append(_result(cfg, push, setting, train_dtype, part, train, timings))
    common = {
        "from": models.model_name(cfg.from_ckpt),
        "to": models.model_name(cfg.to_ckpt),
        "method": cfg.method if push is None else "custom",
        "engine_mode": results[0]["engine_mode"],
        "weight_version": version,
    }
    data = results[0] if len(results) == 1 else {**common, "settings": results}
    if len(results) == 1:
        data["seconds"]["total"] = time.time() - started
    else:
        data["seconds"] = {"total": time.time() - started}
    path = cfg.out / store.REFIT_FILE
    with interrupt.stage("writing"):
        store.writable_dir(cfg.out, "--out")
        store.write_json(path, data)  # the result; the reports render it (probe report again)
        write_refit_reports(data, cfg.out)
    assert fresh is not None
    return RefitResult(data, path, fresh)


def _result(
    cfg: RefitConfig,
    push: Push | None,
    setting: RolloutSetting,
    train_dtype: str,
    part: EngineSide,
    train: Side,
    timings: dict[str, float],
) -> dict[str, Any]:
    """One setting's result: refit.json's body for that setting."""
    sides = {**part.sides, "train": train}
    warm, salted, reset = sides["warm"], sides["salted"], sides["reset"]
    name = Setting(setting, train_dtype).name
    return {
        "setting": name,
        "from": models.model_name(cfg.from_ckpt),
        "to": models.model_name(cfg.to_ckpt),
        "method": cfg.method if push is None else "custom",
        "engine_mode": part.mode,
        "rollout_dtype": setting.dtype,
        "train_dtype": train_dtype,
        "kv_cache_dtype": setting.kv_cache_dtype,
        "weight_version": weight_version(cfg.to_ckpt),
        "sequences": len(part.sequences),
        "cache": {
            "block_size": part.block,
            "warm_cached_tokens": warm.cached,
            "salted_cached_tokens": salted.cached,
            "reset_cached_tokens": reset.cached,
        },
        "audit": _audit(
            part.refitted,
            part.fresh.weights,
            part.perturbed,
            part.layout,
            cfg.to_ckpt,
            part.control,
            part.stored,
        ),
        "links": {
            name: links.compare(sides[low].scores, sides[up].scores)
            for name, (low, up) in LINKS.items()
        },
        "seconds": timings,
    }


def _audit(
    refitted: dict[str, Any],
    fresh: dict[str, Any],
    perturbed: dict[str, Any],
    layout: refit.Layout,
    checkpoint: Path,
    control: str,
    stored: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The audit block of refit.json. ``broken``: the negative control was not named, or the
    fresh engine itself does not hold the checkpoint by the name mapping (the audit's own
    read-back or mapping is wrong, not the refit)."""
    rows, differ, absent = audit.compare_engines(refitted, fresh)
    ckpt = audit.compare_checkpoint(refitted, layout, checkpoint, stored)
    fresh_ckpt = audit.compare_checkpoint(fresh, layout, checkpoint)
    mismatched = sorted(set(differ) | set(ckpt.mismatched))
    named = False
    engine_name = ""
    if control and perturbed:
        place = layout.place(control)
        engine_name = place.engine if place is not None else ""
        _, control_differ, _ = audit.compare_engines(perturbed, fresh)
        control_ckpt = audit.compare_checkpoint(perturbed, layout, checkpoint)
        named = engine_name in control_differ and control in control_ckpt.mismatched
    return {
        "tensors": [r.to_json() for r in rows],
        "mismatched": mismatched,
        "missing": sorted(set(ckpt.missing) | set(absent)),
        "unexpected": ckpt.unexpected,
        "checkpoint_tensors_checked": ckpt.checked,
        "not_compared_to_checkpoint": ckpt.not_compared,
        "experts_not_repacked": ckpt.not_repacked,
        "fresh_vs_checkpoint_mismatched": fresh_ckpt.mismatched,
        "negative_control": {"tensor": control, "engine_tensor": engine_name, "named": named},
        "broken": not named or bool(fresh_ckpt.mismatched),
    }


def _train_side(checkpoint: Path, dtype: str, sequences: list[list[int]]) -> Side:
    """The transformers forward on B: raw log-probabilities of every token after the first."""
    from mismatch_probe.training import rescore

    model = rescore.load_model(checkpoint, dtype)
    requests = [rescore.ScoreRequest(seq[:1], seq[1:]) for seq in sequences]
    raw = SamplingSpec(temperature=1.0, logprobs_mode="raw")
    scored = rescore.rescore(model, requests, raw, flip_eps=0.0)
    del model
    scores = [{i + 1: float(lp) for i, lp in enumerate(s.logprobs)} for s in scored]
    return Side(scores, [0] * len(sequences))


@contextmanager
def _output(cfg: RefitConfig) -> Iterator[None]:
    """The engines' output goes to a log file under the cache, or to the terminal (verbose)."""
    if cfg.verbose:
        yield
        return
    with process.captured(process.new_log_path(models.cache_dir() / "logs")):
        yield


def perturbed_refit_caught(cfg: RefitConfig, fresh: Fresh | None = None) -> tuple[bool, str]:
    """A selftest row: one weight tensor perturbed in a refit -> caught by the refit audit.

    Runs ``run_refit`` with B's tensor (the one the negative control would choose) perturbed in
    the refit itself (a reload from a perturbed copy of B), and checks that the audit names it
    as mismatched (engine and checkpoint name) and that ``probe check`` would fail on it.
    ``fresh``: a fresh engine's side on the same B (``RefitResult.fresh``), not started again.

    Returns:
        (caught, the perturbed checkpoint tensor's name).
    """
    from mismatch_probe.gate.refit import gate_refit

    chosen: list[str] = []
    with tempfile.TemporaryDirectory(prefix="probe-selftest-") as tmp:

        def push(llm: Any, path: Path) -> None:
            if not chosen:  # the refit itself (the control's second refit stays as it is)
                chosen.append(audit.control_tensor(refit.layout(llm, path), path))
                path = audit.perturbed_copy(path, chosen[0], Path(tmp) / "perturbed-b")
            refit.push(llm, refit.RELOAD, path)

        result = run_refit(cfg, None, push, fresh)
    name = chosen[0] if chosen else ""
    parts = refit_settings(result.data)
    verdict = gate_refit(result.data)
    caught = (
        bool(name)
        and all(name in part["audit"]["mismatched"] for part in parts)
        and any("audit:" in f for f in verdict.failures)
    )
    return caught, name
