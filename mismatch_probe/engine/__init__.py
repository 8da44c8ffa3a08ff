"""The engine side: vLLM rollouts, the engine's process, its arguments, batch invariance.

Nothing here imports transformers or the training side (``tests/test_layers.py``).
"""
