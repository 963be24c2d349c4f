"""Copies of an optimizer: copy.deepcopy and pickle.

EMA/SWA utilities and some trainers copy an optimizer. torch's copy keeps
only defaults, state and param_groups; a onebit optimizer's machinery (the
stage schedule, the error buffers, the guards) lives beside them, so all
of it goes. At world size 1 none of it holds a process: the copy is
independent and steps as the original. Past one rank it holds the process
group, the compressed backend and its peers' agreement, which no copy can
share: refused, naming what to do instead.
"""
from __future__ import annotations

# torch's hooks, which torch's own copies leave behind too (its
# __setstate__ starts them empty).
HOOKS_NOT_COPIED = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


def copied_attributes(name: str, world_size: int, sharded: bool, attributes: dict) -> dict:
    """What a copy of optimizer `name` takes of its `attributes` (its
    __dict__), or TypeError where no copy can work (more than one rank, or
    sharded params). torch's __setstate__ takes it back, with empty hooks."""
    if world_size > 1 or sharded:
        raise TypeError(
            f"{name} cannot be copied or pickled across {world_size} "
            "ranks (or on sharded params): it holds the process group and the compressed "
            "backend its peers exchange with. Save state_dict() and "
            "error_feedback_state_dict() instead, and load them into a new optimizer")
    return {k: v for k, v in attributes.items() if k not in HOOKS_NOT_COPIED}
