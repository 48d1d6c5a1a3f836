"""Offline tools that build what the server ships: the trained tiny default model (train_tiny.py)."""
