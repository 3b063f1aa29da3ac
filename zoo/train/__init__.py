"""`zoo.train`: training tasks and the model registry (what `zoo train` / `finetune` /
`info` / `inspect` build by name).

- `ModelSpec`, `register_model`, `model_spec`, `model_names`: the registry of models by
  name (the built-ins `mlp`, `transformer`, `encoder`, `minilm` are registered on import).
- `Task`, `TaskSettings`, `build_task`: a model on its data, built from settings.
- `ConfigError` (settings that cannot run), `RunStopped`, `Preempted`.
"""

from . import _builtin  # noqa: F401 (registers the built-in models)
from ._errors import ConfigError as ConfigError
from ._errors import Preempted as Preempted
from ._errors import RunStopped as RunStopped
from ._registry import ModelSpec as ModelSpec
from ._registry import init_families as init_families
from ._registry import model_names as model_names
from ._registry import model_spec as model_spec
from ._registry import register_model as register_model
from ._task import Task as Task
from ._task import TaskSettings as TaskSettings
from ._task import build_task as build_task
from ._task import classifier_metrics as classifier_metrics
from ._task import lm_metrics as lm_metrics
from ._task import regression_loss as regression_loss
from ._task import regression_metrics as regression_metrics
