"""The checkpoints kvbench runs engines on: seeded random Llama checkpoints written locally
(:mod:`~kvbench.models.random_llama`), the built-in ones cached by preset (:mod:`~kvbench.models.builtin`),
and how far the reference engine's logits move between correct ways of computing them
(:mod:`~kvbench.models.logit_noise`), which the writer uses to size greedy margins."""
