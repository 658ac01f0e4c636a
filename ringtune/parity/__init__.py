"""The parity client: prove through the Tinker API that a CP layout changes nothing but memory (docs/parity.md).

``client`` (``ringtune parity run``), ``compare`` and ``plot`` (``ringtune parity compare``), ``matrix`` and
``servers`` (``ringtune parity matrix``); ``datums`` and ``text`` are the fixed request set, ``windows`` places
its positions in a layout with :mod:`ringtune.layout`.
"""
