"""`toolkit launch` (torch.distributed.run), one rank's entry and how a launch's ranks ended."""
