"""Predictions before a run: model states per rank for every strategy (estimate.py)."""
