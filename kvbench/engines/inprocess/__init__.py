"""Adapters that drive an engine in this process, step by step: ``reference`` (white box: its events, its
block manager's introspection). Imports ``kvbench.core`` and ``kvbench.engines.base``, never another family."""
