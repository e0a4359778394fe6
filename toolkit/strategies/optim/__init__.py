"""The optimizer every strategy steps: AdamW and its schedule (adamw.py), and TorchOptim/TorchState, which every
torch-native strategy holds instead of its own step, checkpoint and export code (torch_optim.py)."""
