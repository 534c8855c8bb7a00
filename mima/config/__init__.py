"""The run configuration: the `model:` options (ModelSettings) and the typed run config that every
command loads (mima.config.run_config). Imports no Lightning and nothing of the training layer."""
