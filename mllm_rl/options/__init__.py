"""The run's options, declared once (``schema.OPTIONS``): flags (``cli``), tasks-file keys, value
checks (``check``), what ``run.json`` records and ``--resume`` compares (``resume``)."""
