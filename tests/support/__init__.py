"""Test support, imported by tests and benchmarks only (never by ``ringtune``): the multi-rank harness
(:mod:`support.harness`), tiny random transformers models (:mod:`support.tiny_models`, needs the ``dev`` extra),
LoRA adapters with nonzero weights (:mod:`support.lora`) and profiled CPU memory (:mod:`support.profiled_memory`).

pytest puts ``tests/`` on ``sys.path`` (the directory of the rootless ``conftest.py``), so tests import
``support.<module>``; a benchmark adds ``tests/`` itself before importing (see benchmarks/README.md).
"""
