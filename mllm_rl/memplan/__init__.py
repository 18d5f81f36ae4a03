"""Memory plans: will a model and batch fit each phase of a colocated step, before a device is rented.

Every figure is **predicted** per device (a compiler's ``memory_analysis``, torch fake tensors or a
layout formula) and says which; ``compose`` lays the backends' figures over the phases."""
