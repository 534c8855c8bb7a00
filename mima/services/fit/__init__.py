"""`mima fit`'s program: a run's config parsed (program), its Trainer built (build_trainer) and fitted
(run); run by the command (mima.commands.fit) and by the Python API (mima.api.fit)."""
