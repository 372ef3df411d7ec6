"""Runnable examples shipped inside the package, so an installed ampkit can run one: ``ampkit fit --config digits``."""
