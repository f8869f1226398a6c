"""otdus: depth up-scaling checkpoint surgery (OT-DUS and its baselines) for Hugging Face LLMs."""

__version__ = "0.1.0"
