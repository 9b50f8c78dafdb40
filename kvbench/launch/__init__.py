"""Server processes kvbench starts: launched in their own process group and stopped with it
(:mod:`~kvbench.launch.process`), placed on cores beside the client (:mod:`~kvbench.launch.placement`),
and found where a real peer is installed (:mod:`~kvbench.launch.peers`). Imports nothing of kvbench above
``kvbench.core``."""
