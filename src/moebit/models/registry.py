"""The one place that knows which model families exist, and the one place a model is made.

    family_of(cfg)               # the family of a model config object
    family_of_dict(d, where)     # of a manifest's model_config dict
    family_of_folder(path)       # of a model folder (a Hugging Face folder), or None
    build_model(train_cfg)       # the model a training config describes
    register(MyFamily())         # a new family: everything else finds it through here

Families are tried in registration order; the first whose ``owns*`` says yes answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from moebit.models.family import ModelFamily
from moebit.models.gpt_family import GPT_FAMILY
from moebit.models.hf.family import HF_FAMILIES
from moebit.models.interface import CausalLM

_FAMILIES: list[ModelFamily] = [GPT_FAMILY, *HF_FAMILIES]


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` (ahead of the built-in ones, so it may claim configs they would not);
    registering a name again replaces the earlier object."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register: {type(family).__name__} does not implement ModelFamily")
    unregister(family.name)
    _FAMILIES.insert(0, family)
    return family


def unregister(name: str) -> None:
    _FAMILIES[:] = [f for f in _FAMILIES if f.name != name]


def families() -> tuple[ModelFamily, ...]:
    return tuple(_FAMILIES)


def family_of(cfg: Any) -> ModelFamily:
    for fam in _FAMILIES:
        if fam.owns(cfg):
            return fam
    raise TypeError(f"no model family for a {type(cfg).__name__} configuration "
                    f"(families: {', '.join(f.name for f in _FAMILIES)})")


def family_of_dict(d: dict[str, Any], where: str = "model_config") -> ModelFamily:
    for fam in _FAMILIES:
        if fam.owns_dict(d):
            return fam
    kind = f"model_type {d['model_type']!r}" if "model_type" in d else "its keys"
    raise ValueError(f"{where}: no model family matches {kind} "
                     f"(families: {', '.join(f.name for f in _FAMILIES)})")


def family_of_folder(path: str | Path) -> ModelFamily | None:
    """The family whose model folder ``path`` is, or None (not a model folder).

    A family that cannot read the folder (a broken config.json) does not own it: the folder
    checks that follow name the broken file, rather than one family's parser error."""
    p = Path(path)
    if not p.is_dir():
        return None
    return next((f for f in _FAMILIES if _owns_folder(f, p)), None)


def _owns_folder(fam: ModelFamily, p: Path) -> bool:
    try:
        return fam.owns_folder(p)
    except (OSError, ValueError):
        return False


def config_from_dict(d: dict[str, Any], where: str = "model_config") -> Any:
    return family_of_dict(d, where).config_from_dict(d)


def new_model(cfg: Any) -> CausalLM:
    """A freshly initialised model (torch's RNG) of a model config of any family."""
    return family_of(cfg).build(cfg)


class HasModelConfig(Protocol):
    init_from: str | None

    def model_config(self) -> Any: ...


def build_model(cfg: HasModelConfig) -> CausalLM:
    """The model ``cfg.model_config()`` describes, freshly initialised from torch's RNG;
    with ``cfg.init_from`` (a model folder), that folder's weights."""
    mcfg = cfg.model_config()
    fam = family_of(mcfg)
    init = getattr(cfg, "init_from", None)
    if init:
        return fam.load_folder(mcfg, Path(init))
    return new_model(mcfg)
