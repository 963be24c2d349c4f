"""python -m onebit CONFIG.json: validate a DeepSpeed-style optimizer config
and print what it would build (on a dummy parameter, at world size 1)."""
import json
import sys

import torch

from .config import build_optimizer, build_scheduler, read_config
from .lr_schedules import SCHEDULES


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        with open(argv[0]) as f:
            config = json.load(f)  # once: the path may be a pipe
        reading = read_config(config)
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(1))], config)
        scheduler = config.get("scheduler")
        if isinstance(scheduler, dict) and scheduler.get("type") in SCHEDULES:
            build_scheduler(opt, config)  # its params checked as the training script's will be
    except (ValueError, OSError) as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 1
    hp = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    print(f"{type(opt).__name__}({', '.join(f'{k}={v!r}' for k, v in hp.items())})")
    for name in ("freeze_step", "var_freeze_step", "comm_backend_name"):
        if hasattr(opt, name):
            print(f"  {name} = {getattr(opt, name)!r}")
    print("what each key of the config does here:")
    for key, verdict, note in reading.notes:
        print(f"  {key:<32} {verdict:<8} {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
