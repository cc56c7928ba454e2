"""p2ptrain: decentralized peer-to-peer training of language models."""

__version__ = "0.1.0"
