"""Models: build/load, blocks, LoRA, export, precision, stage and tensor-parallel cuts, tied-weight names."""
