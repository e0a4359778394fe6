"""The pipeline strategy: stages over ranks, torch.distributed.pipelining schedules."""
