"""Pre-flight: every check of a run YAML and its files before anything is built (``checks.preflight``)."""
