"""Memory arithmetic `toolkit plan` predicts with: model-state bytes from shapes, traced activations."""
