"""The worker: runs the model over a paged KV pool."""
