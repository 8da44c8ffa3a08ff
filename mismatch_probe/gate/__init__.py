"""``probe check``: the CI gate, and the comparison of runs it shares with ``probe compare``.

Public API::

    from mismatch_probe.gate.config import CheckConfig
    from mismatch_probe.gate.baseline import gate
    result = gate(CheckConfig.from_options(run_dir, ["k3_kl=1e-3"]))   # a Gate
    result.passed                                                     # exit 0 or 1

    from mismatch_probe.gate.compare import load_comparison
    comparison = load_comparison([base_dir, head_dir])                  # a Comparison

Module map: ``config`` (``CheckConfig``: every option parsed and cross-checked once),
``bounds`` (``Bound``, ``BoundResult``, ``Increase``: ``--max``, ``--min``, ``--max-increase``),
``baseline`` (``gate``: the integrity gate, every setting's bounds, the growth over a baseline
run), ``bootstrap`` (confidence intervals over sequences: a growth inside the noise does not
fail), ``compare`` (runs loaded side by side, settings paired by name, what differs between
them). Numbers and verdicts only: ``report.gate`` and ``report.compare`` render them.
"""
