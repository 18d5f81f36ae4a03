"""The run's options, declared once (``schema.OPTIONS``) and derived everywhere else: the flags of
``python -m mllm_rl.run`` and ``python -m mllm_rl.memplan`` (``cli``), the keys of a ``--tasks``
file, the checks of every value (``check``), what ``run.json`` records and what ``--resume``
compares (``resume``). Nothing here imports jax, torch or numpy."""
