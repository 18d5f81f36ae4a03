"""Memory plans: will a model and batch fit each phase of a colocated step, before a device is rented.

A plan is **predicted**, never measured: its per-device figures come from a compiler
(``jax.jit(...).lower(...).compile().memory_analysis()`` for a TPU or GPU topology), from
torch fake tensors (``MemTracker``), or from an exact layout formula (a KV pool, a weight
tensor), and each figure says which. ``mllm_rl.memplan.compose`` is backend-neutral: a
backend measures components and compiled functions, the core lays them over the phases of
the schedule (``mllm_rl.memplan.residency``) and checks them against the device's memory.
"""
