"""Data: files -> datasets -> tokenized splits, labels, chat templates, the loss of a micro-batch."""
