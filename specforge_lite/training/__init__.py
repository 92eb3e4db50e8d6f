"""What the train stage is built from: features and their formats, losses, optimisers, checkpoints, tracking, strategies."""
