"""Directory that ``python -m ampkit.legacy`` puts first on ``PYTHONPATH`` so child Python processes
(``multiprocessing`` / ``torch.multiprocessing.spawn`` workers re-running the script) see the apex shim too."""
