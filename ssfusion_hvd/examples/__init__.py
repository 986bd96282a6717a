"""Runnable examples: ``python -m ssfusion_hvd.examples.train`` under ``horovodrun``."""
