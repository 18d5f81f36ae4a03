"""Several RL tasks (each its own model, engine and trainer) on the same devices: ``docs/MULTITASK.md``.

``spec`` (the ``--tasks`` TOML file), ``driver`` (the lease schedule and running it), ``runtime``
(one RL task), ``plan`` (the ``multitask`` plan of ``mllm_rl.run``, with the port allocator).
"""
