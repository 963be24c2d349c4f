"""DiLoCo with 1-bit error-feedback outer gradients: the outer loop
(outer.py), the streaming fragments' schedule (fragments.py) and the checks
for misuse that would go silent (misuse.py). A peer of `onebit.optim`: both
build on `onebit.feedback`."""
from .outer import COMPRESSIONS, DiLoCo, SteppedOuterLR  # noqa: F401
