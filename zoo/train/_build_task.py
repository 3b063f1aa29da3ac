"""`build_task`: the task of any registered model (`zoo.train.model_spec`), on one of its
built-in data sets or on a user's data file (`zoo.train._user_data`).

`zoo train`, `zoo finetune`, `zoo info` and `zoo inspect` all build their model here, so
the same settings give the same model.
"""

from __future__ import annotations

from pathlib import Path

from ._errors import ConfigError
from ._registry import model_spec
from ._task import Task, TaskSettings
from ._user_data import SUFFIXES, user_data_task


def build_task(s: TaskSettings, *, rules, mesh) -> Task:
    """The task of model `s.name` (`zoo.train.model_spec`) on data `s.data`.

    **Arguments:**

    - `s`: the `TaskSettings`.
    - `rules`, `mesh`: pretrained weights are read straight onto `mesh` under `rules`
      (`zoo.hf.from_pretrained`); a model built from scratch is left unplaced.

    **Returns:** the `Task`. Raises `zoo.train.ConfigError` for settings the model does
    not take (an unknown name or data set, `--init` for a model without pretrained
    weights or of another architecture, a dtype it does not compute in).
    """
    spec = model_spec(s.name)
    user_file = s.data is not None and s.data not in spec.datasets and Path(s.data).suffix in SUFFIXES
    if s.data is not None and s.data not in spec.datasets and not user_file:
        raise ConfigError(
            f"--data {s.data!r}: {spec.name} trains on {' or '.join(spec.datasets)}"
            + (" or a .txt/.jsonl/.csv file" if spec.file_model is not None else "")
        )
    if s.dtype not in spec.dtypes:
        raise ConfigError(
            f"--dtype: the {spec.name} computes in float32 only; drop --dtype"
            if spec.dtypes == ("float32",)
            else f"--dtype {s.dtype!r}: the {spec.name} computes in {' or '.join(spec.dtypes)}"
        )
    if s.init and spec.init_class is None:
        raise ConfigError(f"--init: the {spec.name} has no pretrained weights; drop --init")
    if user_file:
        return user_data_task(s, rules=rules, mesh=mesh, validation=s.validation, packed=s.packed,
                              chat_template=s.chat_template)  # fmt: skip
    return spec.build(s, rules=rules, mesh=mesh)
