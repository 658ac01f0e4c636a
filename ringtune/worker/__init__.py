"""Worker ranks: every rank executes the same commands (published by rank 0) on its replica of each run."""
