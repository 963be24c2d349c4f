"""The optimizers: their maths, collaborators, exchanges, checkpoints and
bits, with and without ranks."""
