"""A run's resume stage: the state of a checkpoint (by default the newest intact one) in
place of the freshly built one, refused if the data files changed since."""

from __future__ import annotations

import sys

import equinox as eqx

from .._checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError
from ._build import BuiltRun
from ._errors import ConfigError
from ._plan import RunPlan
from ._user_data import check_fingerprint


def resume(plan: RunPlan, built: BuiltRun) -> tuple[int, Checkpointer | None]:
    """Restore `built`'s model, optimizer state and key from `plan`'s checkpoints when the
    run resumes (`config.resume`; `config.resume_step`, else the newest intact step, a
    damaged newer one skipped with a warning and deleted).

    **Returns:** `(start, checkpointer)`: the restored step (0 and None without resume) and
    the open `Checkpointer`, which the run's checkpoints continue in.
    **Raises:** `ConfigError` naming what cannot be restored and why."""
    c = plan.config
    if not c.resume:  # plan.check_checkpoints made sure there is one, before `steps`
        return 0, None
    # Keeping the best checkpoint, the run's Checkpoint hook rotates them itself (the best pinned).
    checkpointer = Checkpointer(plan.checkpoints, keep=None if c.keep_best else c.keep)
    params, frozen = built.step.partition(built.model)
    like = {"params": params, "opt_state": built.opt_state, "key": built.key}
    try:
        (start, state, _), skipped = checkpointer.restore_intact(like, step=c.resume_step)
    except CheckpointError as e:
        first = str(e).splitlines()[0]
        if not isinstance(e, DamagedCheckpointError):
            hint = " (was it saved with other flags?)"  # a checkpoint that does not fit this run
        else:
            hint = "; start a new run (--overwrite)" if e.step is None else ""
        raise ConfigError(f"--resume: {first}{hint}") from e
    if skipped:
        what = "; ".join(f"step {k}: {why}" for k, why in skipped)
        print(f"zoo: warning: --resume skipped damaged checkpoints ({what}); they are removed, resuming from step "
              f"{start}", file=sys.stderr, flush=True)  # fmt: skip
    check_fingerprint(checkpointer.metadata(start), built.fingerprint, c.data.source, start)
    built.model = eqx.combine(state["params"], frozen)
    built.opt_state, built.key = state["opt_state"], state["key"]
    return start, checkpointer
