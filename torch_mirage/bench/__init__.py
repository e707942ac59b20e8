"""The benchmark suite: DESIGN.md's workloads and end-to-end LLMs, every mode side by side.

``workloads`` (the table), ``llm`` (transformers models, random weights), ``harness`` (the
measurement method), ``report`` (JSON, markdown, plot), ``cli`` (``python -m torch_mirage bench``).
"""
