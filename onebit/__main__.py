"""python -m onebit CONFIG.json: validate a DeepSpeed-style optimizer config
and print what it would build (on a dummy parameter, at world size 1)."""
import sys

import torch

from .config import build_optimizer


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], argv[0])
    except (ValueError, OSError) as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 1
    hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    print(f"{type(opt).__name__}({', '.join(f'{k}={v!r}' for k, v in hp.items())})")
    for name in ("freeze_step", "var_freeze_step", "comm_backend_name"):
        if hasattr(opt, name):
            print(f"  {name} = {getattr(opt, name)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
