"""Worker jobs: what each torchrun worker of a command runs (``entry(cfg)``), apart from the
CLI that composes and launches them (rlbatch-logprobs, rlbatch-export)."""
