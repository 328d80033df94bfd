import torch

# Tests share two cores with the multi-process runs they start.
torch.set_num_threads(1)
