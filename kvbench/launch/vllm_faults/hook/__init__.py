"""The folder a faulted vLLM gets first on its ``PYTHONPATH``: its ``sitecustomize.py`` arms the fault named
by ``KVBENCH_VLLM_FAULT`` in each of the server's processes (:mod:`.kvbench_vllm_faults`). A package only so
that it ships with kvbench; vLLM's processes import its two modules by their bare names."""
