"""Several RL tasks (each its own model, engine and trainer) on the same devices: ``docs/MULTITASK.md``.

``spec`` (the ``--tasks`` TOML file), ``schedule`` (the lease order), ``coord`` (agreement between
processes), ``driver`` (runs the leases), ``runtime`` (one RL task), ``ports`` (one allocator),
``plan`` (the plan ``python -m mllm_rl.run --tasks FILE`` runs, in the one run context of
``mllm_rl.run``).
"""
