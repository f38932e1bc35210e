"""Model tests run tiny tensors: one intra-op thread avoids oversubscription under ``pytest -n 2``
(with two OpenMP threads per worker a tiny linear layer can take 100x longer on 2 cores)."""

import torch

torch.set_num_threads(1)
