"""Training recipes for train.py (ml_collections config files; pick one with --config configs/<name>.py[:arg])."""
