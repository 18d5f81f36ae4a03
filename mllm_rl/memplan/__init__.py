"""Memory plans: will a model and batch fit each phase of a colocated step, before a device is rented.

A plan is **predicted**, never measured: each per-device figure comes from a compiler
(``jax.jit(...).lower(...).compile().memory_analysis()``), torch fake tensors (``MemTracker``) or
an exact layout formula, and says which. Backends measure; ``mllm_rl.memplan.compose`` lays the
figures over the phases and checks them against the device's memory."""
