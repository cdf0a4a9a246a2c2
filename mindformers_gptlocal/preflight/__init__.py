"""Pre-flight: every check of a run YAML and its files before anything is built (``checks.check_run``;
``mf/run_yaml.py`` ``preflight`` runs it, handing it MindFormers' names)."""
