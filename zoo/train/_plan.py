"""A run's plan: its resolved settings, devices, mesh, folders and title, checked before
anything is built or written (`plan_run`), and the folder checks made once its lock is
held (`check_checkpoints`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax

from .._checkpoint import Checkpointer
from .._mismatch import shorten
from .._presets import RULE_PRESETS
from .._presets import rules as preset_rules
from ._config import RunConfig, output_dir
from ._errors import ConfigError
from ._folder import check_folder, owned, previous_outputs, remove_run, strangers
from ._registry import model_spec, pinned_revision
from ._settings import MAX_COUNT
from ._text import mesh_text, parse_mesh
from ._user_data import check_data_file

_WHAT = {"train": "training", "finetune": "LoRA fine-tuning"}


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run will do, decided before anything is built.

    **Fields:**

    - `config`: the `RunConfig` with every default applied (`RunConfig.resolved`), its
      `devices` and `mesh` filled in: what config.json records.
    - `command`: `"train"`, `"finetune"` or `"demo"`.
    - `title`: how the run names itself in its outputs.
    - `output`, `checkpoints`: the run's folder and its checkpoints' folder.
    """

    config: RunConfig
    command: str
    title: str
    output: Path
    checkpoints: Path

    @property
    def mesh_shape(self) -> dict[str, int]:
        """The mesh's axis sizes, `{"data": N, ...}`."""
        return dict(self.config.mesh)


def plan_run(
    config: RunConfig, *, devices: int, command: str | None = None, title: str | None = None, weights: bool = True
) -> RunPlan:
    """The `RunPlan` of `config` on `devices` devices: the run it resumes merged in and
    defaults applied (`RunConfig.resolved`), a fine-tune's `init` where the model needs
    one (unless `weights` is False: `inspect` compiles the step of a model built from
    scratch), the mesh and the batch checked against each other, the folders named (not
    yet created).

    **Raises:** `ConfigError` naming the setting that cannot work."""
    command = command or ("finetune" if config.lora is not None else "train")
    mesh_shape = mesh_shape_of(config.mesh, devices)
    # Every default applied here, once: config.json records the run as it trains.
    config = dataclasses.replace(config.resolved(command), devices=devices, mesh=mesh_shape)
    config = fit_batch(config, rows=None)  # a batch left unset: the most the mesh takes, up to the default
    if weights:  # a Hub id's commit, recorded: resumed, generated from and exported at the same one
        config = dataclasses.replace(config, revision=pinned_revision(config.init, config.revision))
    spec = model_spec(config.model)
    if weights and command != "train" and spec.finetune_needs_init and not config.init:
        raise ConfigError(
            f"zoo {command} {spec.name} needs RunConfig.init PATH: a Hugging Face folder or the output folder of a "
            f"`zoo train {spec.name}` run (e.g. one with RunConfig.output runs/base, then RunConfig.init runs/base)"
        )
    if config.probe and jax.process_count() > 1:  # the probe fits on one process's copy of the features
        raise ConfigError(
            f"RunConfig.probe runs in one process only, and this run has {jax.process_count()}: set "
            "RunConfig.probe 0, or run in one process"
        )
    if config.rules in RULE_PRESETS and preset_rules(config.rules).get("expert") and _dense(config, spec):
        # Before check_layout: its mesh complaint would only lead to the real problem.
        raise ConfigError(
            f"--rules {config.rules} splits a mixture of experts' experts over {preset_rules(config.rules)['expert']!r}, "
            f"but the {config.model} has no experts (num_experts): there are none to place; use dp, fsdp or tp "
            f"(e.g. --rules fsdp)"
        )
    check_layout(config, mesh_shape, devices)
    check_data_file(config)  # the paths only: the build reads the file, once
    output = output_dir(config.output, config.model, command)
    checkpoints = checkpoint_dir(config, output)
    for flag, folder in (("RunConfig.output", output), ("RunConfig.checkpoint_dir", checkpoints)):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{flag} {folder} is a file, not a folder; choose a folder (it is created if missing)")
    if config.tensorboard:  # its writer would fail at the first step, as an unexpected OSError
        check_folder(Path(config.tensorboard), "RunConfig.tensorboard")
    title = title or default_title(config, command)
    return RunPlan(config, command, title, output, checkpoints)


def _dense(config: RunConfig, spec) -> bool:
    """Whether the model of the resolved `config` is known, before it is built, to have no
    mixture of experts: a Hugging Face `init` folder whose config.json names no experts,
    or a model built from scratch (`scratch_config` and `model_config`) without
    `num_experts`. False when it cannot tell (a run folder, a pretrained default): the
    build's check (`_build`) says it then."""
    from ..hf._files import read_json

    if config.init:
        try:
            values = read_json(Path(config.init).expanduser() / "config.json")
        except (OSError, ValueError):  # unreadable: the init's own check says so
            return False
        if not isinstance(values, dict) or "model_type" not in values:  # no folder, or a zoo run's folder
            return False
        return all(values.get(k) is None for k in ("num_experts", "num_local_experts"))
    if spec.pretrained is not None or spec.scratch_config is None:
        return False
    return {**spec.scratch_config, **(config.model_config or {})}.get("num_experts") is None


def default_title(config: RunConfig, command: str) -> str:
    """How a run of the resolved `config` names itself in its outputs when not told."""
    if command == "demo":
        base = "the pretrained all-MiniLM-L6-v2" if config.model == "minilm" else "a pretrained byte LM"
        return f"demo: LoRA fine-tuning of {base} on {config.data.source}"
    what = _WHAT.get(command, command)
    family = init_family(config.init)
    return f"{command} {config.model} ({what} of {family or config.model} on {config.data.source})"


def init_family(init: str | None) -> str | None:
    """The `model_type` (`"llama"`, `"qwen3"`, `"gemma3_text"`) of the Hugging Face folder
    a run's `init` starts from, read from config.json files alone: the folder, its
    `model/`, or for a zoo run's folder the `init` it started from, followed. None when
    no folder here names one (no init, a Hub id, the mlp)."""
    from ..hf._files import read_json

    for _ in range(16):  # a chain of runs, each from the one before (a loop ends here too)
        if not init:
            return None
        folder = Path(init).expanduser()
        try:
            for candidate in (folder, folder / "model"):
                values = read_json(candidate / "config.json") if candidate.is_dir() else None
                if isinstance(values, dict) and "model_type" in values:
                    return str(values["model_type"])
            values = read_json(folder / "config.json") if folder.is_dir() else None
        except (OSError, ValueError):  # unreadable: the init's own check says so, in its words
            return None
        init = values.get("init") if isinstance(values, dict) else None
    return None


def mesh_shape_of(mesh: dict[str, int] | None, devices: int) -> dict[str, int]:
    """The mesh a run on `devices` devices uses: `mesh` (`RunConfig.mesh`), or every
    device on `data`."""
    if mesh is None:
        return {"data": devices}
    total = math.prod(mesh.values())
    if total > devices:
        raise ConfigError(
            f"RunConfig.mesh {mesh_text(mesh)} needs {total} devices but only {devices} were asked for; raise RunConfig.devices"
        )
    return dict(mesh)


def check_layout(config: RunConfig, mesh_shape: dict[str, int], devices: int) -> None:
    """Everything about the mesh and the batch that can fail, before anything is built."""
    if "data" not in mesh_shape:
        raise ConfigError(
            f"RunConfig.mesh {mesh_text(mesh_shape)} has no 'data' axis, which the batch is split over; "
            f"add one, e.g. RunConfig.mesh data={devices}"
        )
    check_rules_fit_mesh(config.rules, mesh_shape, devices)
    data, m, bsz = mesh_shape["data"], config.microbatches, config.batch_size
    if bsz % (data * m):
        unit = data * m
        raise ConfigError(
            f"RunConfig.batch_size {bsz} is not divisible by data-parallel size {data} x microbatches {m} = {unit}; "
            f"use a multiple of {unit}, e.g. {max(unit, round(bsz / unit) * unit)}"
        )


def fit_batch(config: RunConfig, rows: int | None) -> RunConfig:
    """`config` with a derived batch (`RunConfig.derived`: `batch_size` left unset) made
    the largest valid one up to it: a multiple of the data axis x microbatches, at most
    `rows` (the training rows of a data file, once read). When even one row per device
    and microbatch is more than `rows`, a derived `microbatches` is lowered too. A batch
    or microbatches that were given are kept (then `check_layout` / the data say what is
    wrong)."""
    if "batch_size" not in config.derived:
        return config
    data = dict(config.mesh or {}).get("data", 1)
    cap = config.batch_size if rows is None else min(config.batch_size, rows)
    choices = range(config.microbatches, 0, -1) if "microbatches" in config.derived else [config.microbatches]
    for m in choices:
        if cap >= data * m:
            return dataclasses.replace(config, batch_size=cap // (data * m) * data * m, microbatches=m)
    if rows is None:  # the default is below one row per device and microbatch: take that
        return dataclasses.replace(config, batch_size=data * config.microbatches)
    return config  # fewer rows than devices: the data's check names the fix


def fit_epochs(config: RunConfig, rows: int | None) -> RunConfig:
    """`config` with its steps set by `epochs` (`RunConfig.derived`): `epochs` x `rows`
    (the training rows of a data file) / `batch_size`, rounded up; a derived warmup and
    evaluation interval follow the new steps. Unchanged without `epochs`.

    **Raises:** `ConfigError` when the data has no rows to count (a built-in stream)."""
    if config.epochs is None:
        return config
    if rows is None:
        raise ConfigError(
            f"RunConfig.epochs counts passes over a data file's training rows, but {config.data.source} is a "
            "stream without an end: set RunConfig.steps instead, or pass a data file"
        )
    steps = max(1, math.ceil(config.epochs * rows / config.batch_size))
    if steps > MAX_COUNT:
        raise ConfigError(f"RunConfig.epochs {config.epochs} over {rows} rows is {steps} steps, more than {MAX_COUNT}")
    optimizer = config.optimizer
    if "warmup" in config.derived:
        optimizer = dataclasses.replace(
            optimizer, warmup=dataclasses.replace(optimizer, warmup=None).warmup_steps(steps)
        )
    else:
        optimizer.warmup_steps(steps)  # a warmup given must be below the steps
    fitted = dataclasses.replace(config, steps=steps, optimizer=optimizer)
    if "eval_every" in config.derived:
        fitted = dataclasses.replace(fitted, eval_every=dataclasses.replace(fitted, eval_every=None).eval_interval)
    return fitted


def checkpoint_dir(config: RunConfig, output: Path) -> Path:
    """Where the run's checkpoints go: `checkpoint_dir`, else OUTPUT/checkpoints."""
    return Path(config.checkpoint_dir).expanduser() if config.checkpoint_dir else output / "checkpoints"


def check_checkpoints(config: RunConfig, output: Path) -> str | None:
    """`resume` needs a checkpoint before `steps`; a run without it must not write into a
    folder of checkpoints or of another run's outputs (it would mix two runs), unless
    `overwrite`, which deletes only what zoo wrote (`_folder.remove_run`: a folder holding
    files zoo did not write is refused). Checked (read-only) once the folder's lock is
    held, before anything is written.

    A `resume` of a run that stopped before its first checkpoint (killed or crashed: its
    outputs but no summary.json) starts it again from step 0, as a fresh run would: its
    outputs are removed (zoo's only) and the returned line says so (None otherwise); the
    caller trains with `resume` off."""
    folder = checkpoint_dir(config, output)
    saved = []
    if folder.is_dir():
        # Read-only: opening it for writing would delete the temporary folders of saves in flight.
        # An empty step folder (a save that never started writing) is no step.
        saved = [n for n in Checkpointer(folder, read_only=True).steps() if any((folder / str(n)).iterdir())]
    steps = config.steps
    if config.overwrite and not config.resume:
        remove_run(output, folder)
        return
    if config.resume:
        if not saved:
            return _restart(config, output, folder)
        n = config.resume_step
        if n is not None:
            if n not in saved:
                raise ConfigError(f"RunConfig.resume_step {n}: no such checkpoint in {folder}; its steps are {saved}")
            if n >= steps:
                raise ConfigError(
                    f"RunConfig.resume_step {n} is not before RunConfig.steps {steps}; raise RunConfig.steps"
                )
            later = [k for k in saved if k > n]
            if later and not config.overwrite:
                raise ConfigError(
                    f"RunConfig.resume_step {n}: {folder} also holds the later steps {later}, which this run would "
                    "replace; pass RunConfig.overwrite to delete them, or resume from the newest"
                )
            with Checkpointer(folder, keep=None, async_save=False) as ckpt:
                for k in later:
                    ckpt.delete(k)
        elif config.epochs is not None:
            pass  # the steps are known once the data is read: `_build.resume` checks the bound
        elif saved[-1] > steps or (saved[-1] == steps and (output / "summary.json").exists()):
            # (at --steps without a summary: killed after its final checkpoint; the run finishes it)
            raise ConfigError(
                f"RunConfig.resume: the checkpoint in {folder} is at step {saved[-1]}, not before RunConfig.steps {steps}; "
                "raise RunConfig.steps to train further"
            )
    else:
        _check_new(output, folder, saved)
    return None


def _restart(config: RunConfig, output: Path, folder: Path) -> str:
    """`resume` without a checkpoint: a run that stopped before its first one starts again
    (its outputs removed); anything else is refused, naming why."""
    if not previous_outputs(output):
        raise ConfigError(
            f"RunConfig.resume: no checkpoint in {folder} and no earlier run in {output}; run without RunConfig.resume, or point "
            "RunConfig.checkpoint_dir (or RunConfig.output) at the earlier run's"
        )
    if config.resume_step is not None:
        raise ConfigError(
            f"RunConfig.resume_step {config.resume_step}: no checkpoint in {folder}; resume without RunConfig.resume_step"
        )
    if (output / "summary.json").exists():  # finished: its outputs are all it has, never deleted here
        raise ConfigError(
            f"RunConfig.resume: the run in {output} finished without checkpoints (RunConfig.checkpoint_every 0), so it cannot be "
            f"continued; train further from its result in a new run (RunConfig.init {output} RunConfig.output NEW), or pass "
            "RunConfig.checkpoint_every N next time"
        )
    remove_run(output, folder)
    return (
        f"--resume: the run in {output} stopped before its first checkpoint; it starts again from step 0 "
        "(pass --checkpoint-every N to keep steps)"
    )


def _check_new(output: Path, folder: Path, saved: list[int]) -> None:
    """A new run (neither resumed nor overwriting) refuses a folder of another run, and one
    holding files zoo did not write (as `overwrite` would: the run's files would sit among
    them, and only zoo's could ever be replaced)."""
    foreign = owned(output, folder)[1] if previous_outputs(output) else strangers(output, folder)
    if foreign:
        raise ConfigError(
            f"RunConfig.output {output} holds files zoo did not write ({shorten(foreign, 6)}); choose another "
            "RunConfig.output, or move those files away"
        )
    if saved:
        raise ConfigError(
            f"{folder} already holds checkpoints (steps {saved}); pass RunConfig.resume to continue from them, "
            "RunConfig.overwrite to replace that run, or choose another RunConfig.output or RunConfig.checkpoint_dir"
        )
    if previous_outputs(output):
        raise ConfigError(
            f"RunConfig.output {output} already holds another run's outputs ({', '.join(previous_outputs(output))}); "
            "pass RunConfig.overwrite to replace them, or choose another RunConfig.output"
        )


# --------------------------------------------------------------------------- the mesh
# The device mesh of a run: made over the first devices, written as `--mesh` text, and
# checked against the sharding rules before anything is built.


def make_mesh(mesh: dict[str, int] | str | None = None, *, rules: str | None = None, devices: int | None = None):
    """The jax mesh a run lays its arrays out on (`run` and `inspect` build theirs with it).

    **Arguments:**

    - `mesh`: axis name → size, or its text form `"data=4,model=2"` (`RunConfig.mesh`,
      `--mesh`); None: every device on `data`.
    - `rules`: a sharding rules preset (`zoo.RULE_PRESETS`) checked against the mesh first:
      an unknown one, one that shards over an axis the mesh lacks, or a mesh axis over 1
      that no rule uses is refused.
    - `devices`: how many of jax's devices the mesh may span (None: all of them).

    **Returns:** a `jax.sharding.Mesh` over the first devices. **Raises:** `ConfigError`
    saying what to change (a bad text form, more devices than `devices`, rules that do not
    fit).
    """
    import jax

    count = len(jax.devices()) if devices is None else devices
    shape = mesh_shape_of(parse_mesh(mesh) if isinstance(mesh, str) else mesh, count)
    if rules is not None:
        check_rules_fit_mesh(rules, shape, count)
    n = math.prod(shape.values())
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=jax.devices()[:n])


def check_rules_fit_mesh(preset: str, mesh_shape: dict[str, int], devices: int) -> None:
    """Fail fast (before building a model) on an unknown rules preset, or one that uses
    mesh axes the mesh lacks."""
    if preset not in RULE_PRESETS:
        raise ConfigError(f"unknown RunConfig.rules {preset!r}; choose one of {list(RULE_PRESETS)}")
    used: list[str] = []
    for target in preset_rules(preset).values():
        for ax in (target,) if isinstance(target, str) else (target or ()):
            if ax not in used:
                used.append(ax)
    idle = [ax for ax, size in mesh_shape.items() if ax not in used and size > 1]
    if idle:
        raise ConfigError(
            f"RunConfig.mesh {mesh_text(mesh_shape)}: no rule of RunConfig.rules {preset} uses mesh axes {idle}, so their devices "
            f"would repeat the same work; drop them or give them size 1 (e.g. RunConfig.mesh "
            f"{mesh_text({k: v for k, v in mesh_shape.items() if k not in idle})}), or pick rules that use them "
            f"(RunConfig.rules {preset} splits over {used})"
        )
    missing = [ax for ax in used if ax not in mesh_shape]
    if missing:
        model = 2 if "model" in used and devices % 2 == 0 else 1
        example = {"data": devices // model, "model": model}
        example_text = ",".join(f"{k}={v}" for k, v in example.items() if k in used)
        raise ConfigError(
            f"RunConfig.rules {preset} shards over mesh axes {used}, but the mesh {mesh_text(mesh_shape)} lacks "
            f"{', '.join(map(repr, missing))}; pass a mesh with them, e.g. RunConfig.mesh {example_text}"
        )
