"""Training as a library: typed run configs, the `Trainer` and its hooks, `run`, and the
model registry.

- `zoo.train.run(RunConfig(...))`: a whole run as `zoo train` does it (build the model and
  its data, train, evaluate, checkpoint, save, summarise).
- `Trainer(step, batch_at, steps=..., hooks=[...])`: the loop alone, over your own
  `zoo.TrainStep` and batches, with hooks every N steps (`Evaluate`, `KeepBest`,
  `Checkpoint`, `MetricsLog`, `TensorBoard`, `Progress`, `Sample`, or your own `Hook`).
- `OptimizerConfig`: an optax optimizer with its learning-rate schedule; `GRPOConfig`: how
  `objective="grpo"` samples and rewards its rollouts.
- `Flag`: how a config field is `zoo train`'s flag (its help, how `--resume` treats it);
  `RunConfig.flags()` lists them, one per flat key.
- `ModelSpec`, `register_model`, `model_spec`, `model_names`: the models by name (the
  built-ins `mlp`, `transformer`, `encoder`, `minilm` are registered on import); a
  model argument that may be a family or a checkpoint (`check_model_name`,
  `model_and_init`) and the folder an `init` names (`resolve_init`; a `zoo finetune` run
  there is read as its merged model, which `merge_run` writes into zoo's cache);
  `Task`, `build_task`: a model on its data, built from a `RunConfig` (inside
  `abstract_models()`, a model built from scratch as shapes alone); `make_mesh`: the
  mesh a run lays it out on, checked against its rules.
- `ConfigError` (settings that cannot run), `RunStopped` (non-finite), `Preempted` (SIGTERM), `Interrupted` (Ctrl-C, after
  saving a checkpoint).
- `load_run(folder)` → `SavedRun`: a finished run's trained model read back, to predict,
  evaluate on a data file and export merged (`zoo predict` / `zoo eval` / `zoo export`);
  `classification_scores`: accuracy, macro-F1 and per-class scores of predictions.

docs/training.md tells the whole story; docs/models.md the registry.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from . import _builtin  # noqa: F401 (registers the built-in models)

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._build": ("build_task",),
        "._config": ("RunConfig",),
        "._errors": ("ConfigError", "Interrupted", "Preempted", "RunStopped"),
        "._evaluate": ("Evaluator",),
        "._flags": ("Flag",),
        "._hooks": ("Checkpoint", "Evaluate", "KeepBest", "MetricsLog", "Progress", "Sample", "TensorBoard"),
        "._optimizer": ("OPTIMIZERS", "SCHEDULES", "OptimizerConfig"),
        "._plan": ("make_mesh",),
        "._registry": (
            "ModelSpec",
            "check_model_name",
            "init_families",
            "model_and_init",
            "model_names",
            "model_spec",
            "register_model",
            "resolve_init",
        ),
        "._run": ("Inspection", "RunResult", "inspect", "run"),
        "._saved_run": ("SavedRun", "load_run", "merge_run"),
        "._scores": ("classification_scores",),
        "._settings": ("DataConfig", "GRPOConfig"),
        "._task": (
            "Task",
            "abstract_models",
            "classifier_metrics",
            "lm_metrics",
            "regression_loss",
            "regression_metrics",
        ),
        "._trainer": ("Hook", "TrainState", "Trainer"),
    },
)

if TYPE_CHECKING:
    from ._build import build_task as build_task
    from ._config import RunConfig as RunConfig
    from ._errors import ConfigError as ConfigError
    from ._errors import Interrupted as Interrupted
    from ._errors import Preempted as Preempted
    from ._errors import RunStopped as RunStopped
    from ._evaluate import Evaluator as Evaluator
    from ._flags import Flag as Flag
    from ._hooks import Checkpoint as Checkpoint
    from ._hooks import Evaluate as Evaluate
    from ._hooks import KeepBest as KeepBest
    from ._hooks import MetricsLog as MetricsLog
    from ._hooks import Progress as Progress
    from ._hooks import Sample as Sample
    from ._hooks import TensorBoard as TensorBoard
    from ._optimizer import OPTIMIZERS as OPTIMIZERS
    from ._optimizer import SCHEDULES as SCHEDULES
    from ._optimizer import OptimizerConfig as OptimizerConfig
    from ._plan import make_mesh as make_mesh
    from ._registry import ModelSpec as ModelSpec
    from ._registry import check_model_name as check_model_name
    from ._registry import init_families as init_families
    from ._registry import model_and_init as model_and_init
    from ._registry import model_names as model_names
    from ._registry import model_spec as model_spec
    from ._registry import register_model as register_model
    from ._registry import resolve_init as resolve_init
    from ._run import Inspection as Inspection
    from ._run import RunResult as RunResult
    from ._run import inspect as inspect
    from ._run import run as run
    from ._saved_run import SavedRun as SavedRun
    from ._saved_run import load_run as load_run
    from ._saved_run import merge_run as merge_run
    from ._scores import classification_scores as classification_scores
    from ._settings import DataConfig as DataConfig
    from ._settings import GRPOConfig as GRPOConfig
    from ._task import Task as Task
    from ._task import abstract_models as abstract_models
    from ._task import classifier_metrics as classifier_metrics
    from ._task import lm_metrics as lm_metrics
    from ._task import regression_loss as regression_loss
    from ._task import regression_metrics as regression_metrics
    from ._trainer import Hook as Hook
    from ._trainer import Trainer as Trainer
    from ._trainer import TrainState as TrainState

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "Checkpoint",
    "ConfigError",
    "DataConfig",
    "Evaluate",
    "Evaluator",
    "Flag",
    "GRPOConfig",
    "Hook",
    "Inspection",
    "Interrupted",
    "KeepBest",
    "MetricsLog",
    "ModelSpec",
    "OptimizerConfig",
    "Preempted",
    "Progress",
    "RunConfig",
    "RunResult",
    "RunStopped",
    "Sample",
    "SavedRun",
    "Task",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "abstract_models",
    "build_task",
    "check_model_name",
    "classification_scores",
    "classifier_metrics",
    "init_families",
    "inspect",
    "lm_metrics",
    "load_run",
    "make_mesh",
    "merge_run",
    "model_and_init",
    "model_names",
    "model_spec",
    "register_model",
    "regression_loss",
    "regression_metrics",
    "resolve_init",
    "run",
]
