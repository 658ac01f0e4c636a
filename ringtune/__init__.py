"""ringtune: long-context full fine-tuning with context parallelism behind the Tinker API."""

__version__ = "0.1.0"
