"""mismatch_probe: measure the training-inference mismatch of language models.

The pipeline, one module (or package) per stage, the Parquet schema (``store``) as the contract:
prompts (``prompts``) -> rollout engine (``rollout``, vLLM) -> token store -> training-side
rescorer (``rescore``, transformers) -> token store -> metrics (``metrics``) -> reports
(``report``). ``scan`` runs the pipeline; ``cli`` is a thin typer layer over it.
"""

__version__ = "0.1.0"
