"""Task specifications (JSON), installed as the package data ``zo_byzantine.task_specs``."""
