"""The model side: loading (loader), paged attention (attention), the runner and sampler."""
