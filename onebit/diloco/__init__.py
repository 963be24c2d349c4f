"""DiLoCo with 1-bit error-feedback outer gradients: the outer loop
(outer.py), a fragment's round (rounds.py), the streaming fragments'
schedule (fragments.py), the outer lr (outer_lr.py), the arguments
(options.py), checkpoints (checkpoint.py) and the checks for misuse that
would go silent (misuse.py). A peer of `onebit.optim`: both build on
`onebit.feedback`."""
from .options import COMPRESSIONS  # noqa: F401
from .outer import DiLoCo  # noqa: F401
from .outer_lr import SteppedOuterLR  # noqa: F401
