"""The training engine: batches, microbatches, gradient reduction, optimizer, checkpoints."""
