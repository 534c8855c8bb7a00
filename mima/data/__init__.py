"""Tasks, suites and the MIMA batch schedule (mima.data.registry: tasks and suites by name;
mima.data.tasks: TaskSpec, TaskData). The package imports nothing itself, so that the command line
can read mima.data.benchmarks before torch is loaded."""
