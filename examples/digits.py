"""The examples' data: scikit-learn's digits (1797 8x8 images, 10 classes),
split 80/20 and standardised with the training statistics.

The examples import it as `digits` (their own folder is on `sys.path` when run
as scripts); the checkout's convergence benchmark imports it as
`examples.digits`.
"""
import torch


def load_digits_split(seed: int = 0):
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - dev extra
        raise SystemExit("the convergence benchmark needs scikit-learn: pip install scikit-learn") from exc
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    tr, te = perm[:cut], perm[cut:]
    # Standardise with training statistics; constant pixels stay exactly 0.
    mean, std = x[tr].mean(0), x[tr].std(0)
    x = torch.where(std > 0, (x - mean) / std.clamp_min(1e-6), torch.zeros_like(x))
    return x[tr], y[tr], x[te], y[te]
