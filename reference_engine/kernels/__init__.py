"""The engine's kernels: faster paths for one operation each, every one held by its tests to the readable
torch path it replaces (the oracle stays in the engine's core: :mod:`reference_engine.attention` and the
layers of :mod:`reference_engine.model`).

- :mod:`~reference_engine.kernels.cpu_attention`: paged decode attention in C++ for the CPU (``csrc/paged_decode.cpp``)
- :mod:`~reference_engine.kernels.triton_attention`: paged decode attention in Triton for CUDA
- :mod:`~reference_engine.kernels.cpu_linear`: matmuls with weights prepacked for oneDNN on the CPU
- :mod:`~reference_engine.kernels.cpu_elementwise`: fused RMSNorm and SwiGLU in C++ for the CPU
  (``csrc/fused_elementwise.cpp``)
- :mod:`~reference_engine.kernels.cpu_build`: building the C++ sources on first use
- :mod:`~reference_engine.kernels.backends`: which path each ``EngineConfig.*_backend`` setting resolves to
  on a device, one table for all three

Kernels stand below the engine's core: they import nothing of ``reference_engine`` outside this package
(``tests/test_layout.py``). Nothing is imported here, so ``import reference_engine`` never pays for triton
or a C++ build.
"""
