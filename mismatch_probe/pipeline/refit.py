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
from mismatch_probe.sampling import SamplingSpec
from mismatch_probe.settings import RolloutSetting

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


def _engine_kwargs(cfg: RefitConfig, model: Path, max_len: int) -> dict[str, Any]:
    spec = SamplingSpec(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
    setting = RolloutSetting(cfg.rollout_dtype, cfg.kv_cache_dtype)
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


def run_refit(
    cfg: RefitConfig, console: Any, push: Push | None = None, fresh: Fresh | None = None
) -> RefitResult:
    """The whole refit measurement (module docstring); writes ``refit.json`` into ``cfg.out``.

    Args:
        push: how B reaches the running engine (default: ``cfg.method``'s); a test's wrong refit.
        fresh: a fresh engine's side on the same B and sequences (not started again).

    Raises:
        ProbeError: bad input; ``refit.RefitError``: the method cannot run on this engine
            (every engine is stopped first).
    """
    cfg.check()
    started = time.time()
    with process.importing():
        from transformers import AutoTokenizer

        process.import_vllm_quietly(cfg.verbose)
    tokenizer = AutoTokenizer.from_pretrained(cfg.from_ckpt, local_files_only=True)
    chat = bool(getattr(tokenizer, "chat_template", None)) if cfg.chat is None else cfg.chat
    context = int(getattr(tokenizer, "model_max_length", 1 << 20))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.from_ckpt, local_files_only=True)
    context = min(context, int(getattr(config, "max_position_embeddings", context)))
    encoded = encode_prompts(_prompts(cfg), tokenizer, chat, context, cfg.max_tokens)
    max_len = min(context, max(len(p.token_ids) for p in encoded) + cfg.max_tokens + 1)
    spec = SamplingSpec(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed)
    do_push = push or (lambda llm, path: refit.push(llm, cfg.method, path))
    version = weight_version(cfg.to_ckpt)
    timings: dict[str, float] = {}
    with _output(cfg), tempfile.TemporaryDirectory(prefix="probe-refit-") as tmp:
        kwargs_a = _engine_kwargs(cfg, cfg.from_ckpt, max_len)
        mark = time.perf_counter()
        with _engine(kwargs_a, cfg.method) as llm:
            if cfg.method == refit.LOAD_WEIGHTS and push is None:
                reason = refit.load_weights_refusal(llm)
                if reason:
                    raise refit.RefitError(f"--method load-weights: {reason}")
            block = refit.cached_block_tokens(llm)
            with interrupt.stage("generation"):
                rollouts = rollout.generate(llm, encoded, spec, 1)
            sequences = [[*r.prompt_ids, *r.response_ids] for r in rollouts]
            layout = refit.layout(llm, cfg.to_ckpt)
            push_start = time.perf_counter()
            do_push(llm, cfg.to_ckpt)
            timings["push"] = time.perf_counter() - push_start
            refitted = refit.effective_weights(llm)
            stored = refit.stored_experts(llm)
            warm = Side.of(refit.score_cached(llm, sequences))
            salted = Side.of(refit.score_cached(llm, sequences, salt=f"weights-{version}"))
            llm.reset_prefix_cache()
            reset = Side.of(refit.score_cached(llm, sequences))
            control = audit.control_tensor(layout, cfg.to_ckpt)
            perturbed: dict[str, Any] = {}
            if control:
                copy = audit.perturbed_copy(cfg.to_ckpt, control, Path(tmp) / "perturbed")
                do_push(llm, copy)
                perturbed = refit.effective_weights(llm)
        timings["refitted_engine"] = time.perf_counter() - mark
        if fresh is None or fresh.sequences != sequences:
            mark = time.perf_counter()
            with _engine(_engine_kwargs(cfg, cfg.to_ckpt, max_len), refit.RELOAD) as llm_b:
                fresh = Fresh(sequences, refit.effective_weights(llm_b),
                              Side.of(refit.score_cached(llm_b, sequences)))  # fmt: skip
            timings["fresh_engine"] = time.perf_counter() - mark
    mark = time.perf_counter()
    train = _train_side(cfg, sequences)
    timings["training"] = time.perf_counter() - mark
    sides = {"warm": warm, "salted": salted, "reset": reset, "fresh": fresh.side, "train": train}
    data = {
        "from": models.model_name(cfg.from_ckpt),
        "to": models.model_name(cfg.to_ckpt),
        "method": cfg.method if push is None else "custom",
        "engine_mode": rollout.engine_mode(rollout.engine_env(kwargs=kwargs_a)),
        "rollout_dtype": cfg.rollout_dtype,
        "train_dtype": cfg.train_dtype,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "weight_version": version,
        "sequences": len(sequences),
        "cache": {
            "block_size": block,
            "warm_cached_tokens": warm.cached,
            "salted_cached_tokens": salted.cached,
            "reset_cached_tokens": reset.cached,
        },
        "audit": _audit(refitted, fresh.weights, perturbed, layout, cfg.to_ckpt, control, stored),
        "links": {
            name: links.compare(sides[low].scores, sides[up].scores)
            for name, (low, up) in LINKS.items()
        },
        "seconds": {**timings, "total": time.time() - started},
    }
    path = cfg.out / store.REFIT_FILE
    store.writable_dir(cfg.out, "--out")
    store.write_json(path, data)
    write_refit_reports(data, cfg.out)
    return RefitResult(data, path, fresh)


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


def _train_side(cfg: RefitConfig, sequences: list[list[int]]) -> Side:
    """The transformers forward on B: raw log-probabilities of every token after the first."""
    from mismatch_probe.training import rescore

    model = rescore.load_model(cfg.to_ckpt, cfg.train_dtype)
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
    mismatched = result.data["audit"]["mismatched"]
    verdict = gate_refit(result.data)
    caught = (
        bool(name) and name in mismatched and any(f.startswith("audit:") for f in verdict.failures)
    )
    return caught, name
