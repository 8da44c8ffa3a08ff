"""The training side: the transformers rescorer, device maps, the engine's logit processing.

Nothing here imports vLLM or the engine side (``tests/test_layers.py``).
"""
