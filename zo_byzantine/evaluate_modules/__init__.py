"""Local ``evaluate`` modules: ``evaluate.load(<path to file>)`` needs no network."""
