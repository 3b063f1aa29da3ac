"""An adapter folder's two JSON files, as peft and zoo read them (`zoo.lora.save_adapter` /
`load_adapter`; the folder's layout is `zoo.lora._io`'s docstring): their names, peft's
`adapter_config.json` read and checked (features zoo lacks refused, zoo's `target_modules`
and `modules_to_save` found from peft's names, one scaling for every branch), and
`zoo_adapter.json`, zoo's record of the model it was saved from, for the checks and the
messages of a load into another model."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

from .._mismatch import shorten
from ..nn import Embedding
from ._apply import (
    ADAPTED,
    LINEARS,
    TIED_HEAD,
    _all_module_names,
    modules,
    outermost,
)
from ._config import INITS, LoraConfig
from ._layer import LoraLinear
from ._names import (
    hf_module_name,
    layer_names,
    lead,
    saved_by_older_peft,
    saves,
    select,
)

CONFIG_NAME = "adapter_config.json"


WEIGHTS_NAME = "adapter_model.safetensors"


ZOO_NAME = "zoo_adapter.json"


# A mean-pooling classifier's head, apart from peft's files: torch `nn.Linear`'s state dict.
HEAD_NAME = "head.safetensors"


FILE_NAMES = (WEIGHTS_NAME, CONFIG_NAME, ZOO_NAME, HEAD_NAME)  # what save_adapter writes


PREFIX = "base_model.model."

# peft features zoo's LoRA does not have: refused on load rather than silently ignored.
# (`rank_pattern` / `alpha_pattern` are checked module by module: zoo reads the ones it writes.)
_UNSUPPORTED = ("layers_to_transform", "layer_replication", "lora_bias")


def _module_of(key: str) -> str:
    """The HF module name of an adapter file key (`base_model.model.X.lora_A.weight` → `X`)."""
    name = key.removeprefix(PREFIX)
    match = re.fullmatch(r"(.*)\.lora_[AB](\.[^.]+)?\.weight", name)
    return match.group(1) if match else name.rsplit(".", 1)[0]


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _describe(model: Any) -> dict[str, Any]:
    """The zoo model's class and config, recorded for load-time checks and messages."""
    out: dict[str, Any] = {"model": type(model).__name__}
    config = getattr(model, "config", None)
    if config is None and hasattr(model, "encoder"):
        config = model.encoder.config
        out["num_labels"] = getattr(model, "num_labels", None)
        out["pooling"] = getattr(model, "pooling", None)
    if dataclasses.is_dataclass(config):
        out["model_config"] = _json_safe(dataclasses.asdict(config))
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _base_named(model: Any, given: str | None) -> dict[str, str | None]:
    """What an adapter of `model` names as its base (`base_model_name_or_path`, and
    `revision`): `given`, else the folder `zoo.hf` loaded it from, or the Hub id and commit
    of that folder when it is a snapshot of the Hugging Face cache (`zoo.hf._hub.hub_id_of`)."""
    from ..hf._hub import hub_id_of  # zoo.hf imports zoo.models; imported late
    from ..hf._peft import source_of

    if given:
        return {"base_model_name_or_path": given}
    folder = source_of(model)
    name, revision = hub_id_of(folder) or (folder, None)
    return {"base_model_name_or_path": name, "revision": revision}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} does not hold a JSON object")  # noqa: TRY004
    return values


def _read_config(directory: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if not directory.is_dir():
        raise FileNotFoundError(f"no adapter directory at {str(directory)!r}")
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{str(directory)!r} is not a complete LoRA adapter: missing {', '.join(missing)} "
            f"(an adapter holds {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    values = _read_json(directory / CONFIG_NAME)
    if values.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"{directory} holds a {values.get('peft_type')!r} adapter; zoo.lora loads only LoRA (peft_type 'LORA')"
        )
    unsupported = [k for k in _UNSUPPORTED if values.get(k)]
    if unsupported:
        raise ValueError(
            f"{directory / CONFIG_NAME} uses peft features zoo.lora does not support: "
            + ", ".join(f"{k}={values[k]!r}" for k in unsupported)
        )
    meta = _read_json(directory / ZOO_NAME) if (directory / ZOO_NAME).is_file() else None
    return values, meta


def _from_peft_names(model: Any, values: dict[str, Any], keys: frozenset[str] = frozenset()) -> tuple[Any, Any]:
    """Zoo `target_modules` and `modules_to_save` for an adapter peft (not zoo) wrote:
    each zoo module is chosen when the peft names of all its layers match. `keys`: the
    tensor names of the adapter's file (which modules an older peft saved)."""
    targets = values.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        zoo_targets: Any = "all-linear"
    elif not targets and values.get("target_parameters"):
        zoo_targets = ()  # the experts alone (`target_parameters`)
    else:
        patterns = tuple(targets) if isinstance(targets, list) else targets
        exclude = values.get("exclude_modules")
        exclude = tuple(exclude) if isinstance(exclude, list) else exclude
        candidates = list(modules(model, (*LINEARS, Embedding, *ADAPTED)))
        picked = select(model, candidates, patterns, "the adapter's target_modules")
        if getattr(model, TIED_HEAD, "absent") is None and any(
            t == TIED_HEAD or t.endswith("." + TIED_HEAD) for t in (targets if isinstance(targets, list) else [])
        ):
            picked.append(TIED_HEAD)  # the tied head: the token embedding (`tied_head` checks the tying)
        if exclude is not None:
            dropped = set(select(model, picked, exclude, "the adapter's exclude_modules"))
            picked = [n for n in picked if n not in dropped]
        zoo_targets = tuple(picked)
        if not zoo_targets:
            raise ValueError(
                f"the adapter's target_modules {targets!r} match no Linear layer of this {type(model).__name__}; "
                f"its layers' peft names are e.g. {_example_names(model)}"
            )
    save = values.get("modules_to_save")
    zoo_save = None
    if save:
        # peft's rule on the HF names peft saw: a module named by an entry or ending in
        # ".entry" ("norm": model.norm). An entry that matches nothing is allowed, as peft
        # allows it (SEQ_CLS adds "score"); entries that together match nothing are refused.
        names = [n for n in _all_module_names(model) if not n.endswith(".base")]
        picked = select(model, names, tuple(save), "the adapter's modules_to_save", rule=saves, zoo_names=False)
        # peft up to 0.21 matched a plain suffix ("norm": each layer's input_layernorm too)
        # and saved what it matched: where the file holds those modules, they are read.
        older = select(
            model, names, tuple(save), "the adapter's modules_to_save", rule=saved_by_older_peft, zoo_names=False
        )
        extra = [n for n in outermost(older) if n not in picked]
        if extra and all(_in_file(model, n, keys) for n in extra):
            picked = older
        zoo_save = tuple(outermost(picked))
        if not zoo_save:
            innermost = [n for n in names if not any(m.startswith(n + ".") for m in names)]
            raise ValueError(
                f"the adapter's modules_to_save {save!r} match no module of this {type(model).__name__}: peft "
                "saves every module whose Hugging Face name is an entry or ends with .entry, and this model's are e.g. "
                f"{_example_names(model, innermost)}; load it into the model it was trained on"
            )
    return zoo_targets, zoo_save


def _in_file(model: Any, name: str, keys: frozenset[str]) -> bool:
    """Whether the adapter's tensors hold zoo module `name` at every layer (peft saves a
    module whole: `{PREFIX}{its HF name}.weight`, ...)."""
    return all(any(k.startswith(f"{PREFIX}{hf}.") for k in keys) for hf in layer_names(model, name))


def _example_names(model: Any, names: list[str] | None = None) -> list[str]:
    """Layer 0's HF / peft names of the first 8 of `names` (default: the Linear layers)."""
    names = list(modules(model, (*LINEARS, LoraLinear))) if names is None else names
    return [hf_module_name(model, n, (0,) * len(lead(model, n))) for n in names[:8]]


def _lora_config(
    base: Any, values: dict[str, Any], meta: dict[str, Any] | None, keys: frozenset[str] = frozenset()
) -> LoraConfig:
    fields = dict(values)
    init = fields.get("init_lora_weights")
    if isinstance(init, str) and (init.startswith(("pissa_niter_", "corda", "loftq"))):
        raise ValueError(
            f"this adapter was made with peft's init_lora_weights={init!r}, which changed the base weights it applies "
            "to in a way zoo cannot recompute; save it in peft with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=<the adapter saved at initialisation>) "
            "for an adapter of the original base, and load that"
        )
    if init not in INITS:
        fields["init_lora_weights"] = True  # peft's other inits (eva, orthogonal, …): the file holds the result
    if meta is not None and "target_modules" in meta:
        for k in ("target_modules", "exclude_modules", "modules_to_save", "target_parameters"):
            fields[k] = meta.get(k)
    else:
        fields["target_modules"], fields["modules_to_save"] = _from_peft_names(base, values, keys)
        fields["exclude_modules"] = None
    return LoraConfig.from_peft_dict(fields)


def _check_meta(model: Any, meta: dict[str, Any] | None, values: dict[str, Any], names: Any, where: Path) -> None:
    """Refuse adapters whose outputs this model would silently compute differently."""
    if meta is not None:
        recorded = meta.get("model")
        if recorded is not None and recorded != type(model).__name__:
            raise ValueError(
                f"this adapter was saved from a zoo {recorded}; it cannot be loaded into a {type(model).__name__}"
            )
        pooling = getattr(model, "pooling", None)
        if meta.get("pooling") is not None and pooling is not None and meta["pooling"] != pooling:
            raise ValueError(
                f"this adapter was saved from an {recorded} with pooling={meta['pooling']!r}; this one has "
                f"pooling={pooling!r}, so its head would see other features: build it with pooling={meta['pooling']!r}"
            )
    elif names is not None and values.get("task_type") == "SEQ_CLS" and not names.cls_pooling:
        raise ValueError(
            f"{where} is a peft SEQ_CLS adapter: peft trained it on {names.architecture}, which classifies the "
            f"[CLS] token through BERT's pooler (dense + tanh), but this {type(model).__name__} mean-pools and would "
            "give other logits. Load the classifier with zoo.hf.load_bert_classifier (pooling='cls'), or build "
            "it with EncoderClassifier(..., pooling='cls')."
        )


def _peft_scaling(values: dict[str, Any], module: str, rank: int) -> float:
    """peft's scaling of the branch on HF module `module` whose A has `rank` rows."""
    alpha = values.get("lora_alpha", 8)
    for key, value in (values.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if values.get("use_rslora") else rank)


def _check_scaling(tensors, values, config: LoraConfig, directory: Path) -> None:
    """peft's scaling of every branch in the file is zoo's one scaling (else `ValueError`)."""
    wrong = []
    for k, value in tensors.items():
        if k.endswith(".lora_A.weight"):
            module = _module_of(k)
            scaling = _peft_scaling(values, module, value.shape[0])
            rank = value.shape[0]
            if not math.isclose(scaling, config.scaling, rel_tol=1e-9):
                wrong.append(f"{module} (rank {rank}, scaling {scaling})")
    if wrong:
        raise ValueError(
            f"zoo gives every LoRA branch one scaling, {config.scaling} (lora_alpha {config.lora_alpha}, r {config.r}"
            f"{', rsLoRA' if config.use_rslora else ''}), but {directory / CONFIG_NAME}'s rank_pattern / alpha_pattern "
            f"give these modules another: {shorten(sorted(wrong), 8)}"
        )


def _config_diffs(model: Any, meta: Any) -> list[str]:
    """How the config the adapter was saved with differs from `model`'s (`key: saved X,
    this model Y`), from the adapter's zoo metadata; empty without it."""
    if not isinstance(meta, dict):
        return []
    mine = _describe(model)
    saved_cfg, my_cfg = meta.get("model_config") or {}, mine.get("model_config") or {}
    diffs = [
        f"{k}: saved {saved_cfg.get(k)!r}, this model {my_cfg.get(k)!r}"
        for k in sorted(set(saved_cfg) | set(my_cfg))
        if saved_cfg.get(k) != my_cfg.get(k)
    ]
    if meta.get("num_labels") != mine.get("num_labels"):
        diffs.append(f"num_labels: saved {meta.get('num_labels')!r}, this model {mine.get('num_labels')!r}")
    return diffs


def _config_diff(model: Any, meta: Any) -> str:
    diffs = _config_diffs(model, meta)
    return ("\n  the model configs differ: " + "; ".join(diffs)) if diffs else ""


def _why_not(values: dict[str, Any], unexpected: list[str], misshaped: list[str], model: Any, meta: Any) -> str:
    """The likely cause of a mismatch that adapter_config.json shows: other ranks by `rank_pattern`.
    Not when the adapter's zoo metadata names another base config: that is the cause then
    (zoo itself writes a fused `c_attn`'s rank 3·r in `rank_pattern`)."""
    hints = []
    pattern = {m: r for m, r in (values.get("rank_pattern") or {}).items() if r != values.get("r")}
    if pattern and misshaped and not _config_diffs(model, meta):
        hints.append(
            f"rank_pattern gives {shorten(sorted(f'{m}: {r}' for m, r in pattern.items()), 3)} another "
            f"rank than r {values.get('r')}, but zoo gives every branch one rank: train it without "
            "rank_pattern"
        )
    return "".join(f"; {h}" for h in hints)


def _first_diff(model: Any, meta: Any) -> str:
    """The first few config differences, for a message's first line (or nothing)."""
    diffs = _config_diffs(model, meta)
    return f"; the model configs differ ({shorten(diffs, 3)}): an adapter of another base model?" if diffs else ""
