"""A training run's writer, as a process of its own, for ``probe watch`` tests:
``python -m tests.watch_writer FORMAT DIR --steps N [--every S] [--fault STEP]``.

``prime-rl``: each step's ``rank_0.jsonl`` is written in two halves ``S/3`` seconds apart (a
half-written step is on disk for that long), then ``STABLE`` is touched. ``probe``: a
``ProbeWriter`` writes each step in two batches ``S/3`` apart (the step's manifest comes with
the next step, or at exit). At ``--fault STEP`` the training side drops by 1 nat on every token
(k3 = e^-1 ≈ 0.37), an alert for any ``--max k3_kl`` below that. The data are
``synthetic_steps(range(1, N + 1), seqs=4, growth=0.002)``, so a test rebuilds them exactly.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tests.ingest_fixtures import Seq, synthetic_steps, write_prime_rl

SEQS = 4
GROWTH = 0.002
FAULT_SHIFT = 1.0


def steps_data(n: int, fault: int | None) -> dict[int, list[Seq]]:
    data = synthetic_steps(list(range(1, n + 1)), seqs=SEQS, growth=GROWTH)
    if fault is not None and fault in data:
        data[fault] = [
            Seq(s.prompt, s.response, s.rollout, [x - FAULT_SHIFT for x in s.train])
            for s in data[fault]
        ]
    return data


def prime_step(root: Path, step: int, seqs: list[Seq], pause: float) -> None:
    """One step: the rank file in two halves, then ``STABLE``."""
    scratch = root / f".scratch-{step}"
    write_prime_rl(scratch, {step: seqs}, stable=False)
    text = (scratch / "token_exports" / f"step_{step}" / "rank_0.jsonl").read_text()
    directory = root / "token_exports" / f"step_{step}"
    directory.mkdir(parents=True, exist_ok=True)
    half = len(text) // 2
    with (directory / "rank_0.jsonl").open("w") as fh:
        fh.write(text[:half])
        fh.flush()
        time.sleep(pause)
        fh.write(text[half:])
    (directory / "STABLE").touch()


def probe_step(writer: object, step: int, seqs: list[Seq], pause: float) -> None:
    """One step in two batches of two sequences each."""
    for half in (seqs[:2], seqs[2:]):
        width = max(len(s.response) for s in half)
        tokens = [s.response + [0] * (width - len(s.response)) for s in half]
        mask = [[1] * len(s.response) + [0] * (width - len(s.response)) for s in half]
        rollout = [s.rollout + [0.0] * (width - len(s.rollout)) for s in half]
        train = [s.train + [0.0] * (width - len(s.train)) for s in half]
        writer.write_step(step, tokens, mask, rollout, train)  # type: ignore[attr-defined]
        time.sleep(pause)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("format", choices=("prime-rl", "probe"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=float, default=1.0)
    parser.add_argument("--fault", type=int, default=None)
    args = parser.parse_args()
    data = steps_data(args.steps, args.fault)
    args.dir.mkdir(parents=True, exist_ok=True)
    writer = None
    if args.format == "probe":
        from mismatch_probe.ingest import ProbeWriter

        writer = ProbeWriter(args.dir, max_off_policy_steps=0)
    for step, seqs in data.items():
        start = time.monotonic()
        if writer is None:
            prime_step(args.dir, step, seqs, args.every / 3)
        else:
            probe_step(writer, step, seqs, args.every / 3)
        print(json.dumps({"written": step}), flush=True)
        time.sleep(max(args.every - (time.monotonic() - start), 0.0))
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
