"""mismatch_probe: measure the training-inference mismatch of language models.

The data flows one way, one package per stage, the Parquet schema (``store``) as the contract:
prompts (``prompts``) -> rollout (``engine``: vLLM) -> rescoring (``training``: transformers) ->
token store (``store``) -> metrics (``metrics``) -> reports (``report``, the only package that
renders). ``pipeline`` orchestrates a scan (stages, records, run metadata, sharding, Ray,
attribution); ``ingest`` reads RL frameworks' logs into the same store; ``cli`` is a thin typer
layer over both. The engine and training sides never import each other (``tests/test_layers.py``).
"""

__version__ = "0.1.0"
