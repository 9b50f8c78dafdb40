"""Servers for tests, shipped so that other engines' suites can use them too: a stub OpenAI-compatible
server whose every answer is predictable (:mod:`~kvbench.testing.stub_server`) and the reference server
with a fault patched into its engine (:mod:`~kvbench.testing.patched_server`)."""
