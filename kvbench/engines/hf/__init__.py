"""Adapters over Hugging Face transformers: ``hf`` (:mod:`~kvbench.engines.hf.generate`, plain ``generate``,
the ground truth for outputs) and ``hf-cb`` (:mod:`~kvbench.engines.hf.continuous_batching`, with its
:mod:`~kvbench.engines.hf.probe`). Imports ``kvbench.core`` and ``kvbench.engines.base``, never another family."""
