"""Reading models, checkpoints and data; writing scores."""
