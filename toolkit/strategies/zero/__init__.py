"""DeepSpeed ZeRO stages 0-3 (+ offload): its engine, config, checkpoint pieces and memory rules.

Imported only when a zero run sets up or a plan predicts one."""
