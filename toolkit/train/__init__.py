"""The one training loop, its checks, evaluation and the run record (run.json)."""
