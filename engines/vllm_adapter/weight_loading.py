"""The weight-loading contract: `_duplicate_context_kv_weights` and `K3DSparkForCausalLM.hf_to_vllm_mapper`
(nvidia/dspark_mla.py) with the real `WeightsMapper` (model_executor/models/utils.py)."""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3num.engines import source
from k3num.engines.vllm_adapter.common import DSPARK_PY, UTILS_PY


def _bind_weight_loading(root: Path) -> Any:
    utils = root / UTILS_PY
    logger = logging.getLogger("k3num.vllm")
    logger.warning_once = logger.warning  # type: ignore[attr-defined]
    ns = {"field": field, "dataclass": dataclass, "Mapping": Mapping, "Iterable": Iterable, "re": re,
          "torch": torch, "logger": logger, "ShardIds": Any, "WeightRenaming": Any}
    mapper_cls = source.lift_class(utils, "WeightsMapper", ns)
    mapper = source.lift_value(root / DSPARK_PY, "K3DSparkForCausalLM.hf_to_vllm_mapper",
                               {"WeightsMapper": mapper_cls})
    duplicate = source.lift(root / DSPARK_PY, "_duplicate_context_kv_weights",
                            {"torch": torch, "Iterable": Iterable})
    return types.SimpleNamespace(duplicate=duplicate, mapper=mapper)


