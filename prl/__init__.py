"""prl: Slurm-native asynchronous RL post-training of LLMs."""

__version__ = "0.1.0"
