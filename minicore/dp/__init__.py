"""Data parallelism: the DP process group over torch.distributed (the DP engine loop is to come)."""
