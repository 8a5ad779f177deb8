"""The expert tier: `--overlap-tp-config FILE`, a JSON or YAML file keyed by op kind (docs/config.md).

    {"ag_gemm": {"transport": "p2p", "chunk_by": "peer"},      # OverlapConfig fields of every linear's AllGather+GEMM
     "gemm_rs": {"rs_transfer": "copy"},                       # ... GEMM+ReduceScatter
     "gemm_ar": {"method": "off"},                             # ... GEMM+AllReduce (no sequence parallelism)
     "expert":  {"transport": "p2p"},                          # the MoE layers' expert ops (a2a_gemm, gemm_a2a)
     "layers":  {"gather_in_place": true, "token_split": false}}   # OverlapSettings' layer switches

Every key is optional; what a file leaves out is decided by `--overlap-tp` / `--overlap-moe` and the resolver
(overlap_tp/ops/resolve.py). A bad key or value is an OverlapArgumentError naming it.
"""
import json
import os
from typing import Mapping, Union

from overlap_tp.megatron.arguments import OverlapArgumentError
from overlap_tp.megatron.settings import LAYER_SWITCHES, OP_KINDS
from overlap_tp.ops.config import OverlapConfig

SECTIONS = OP_KINDS + ("expert", "layers")
CONFIG_FIELDS = tuple(OverlapConfig.__dataclass_fields__)


def read_config_file(source: Union[str, Mapping]) -> dict:
    """The checked content of an expert config file: {section: {key: value}} with each op section's fields made into
    an OverlapConfig's keywords (validated by building one) and the layer switches booleans. `source`: a path (.json,
    or .yaml / .yml, which needs PyYAML), or the mapping such a file holds (Python callers)."""
    where = "--overlap-tp-config"
    if isinstance(source, Mapping):
        content = source
    else:
        where = f"--overlap-tp-config {source}"
        if not os.path.isfile(source):
            raise OverlapArgumentError(f"{where}: no such file")
        with open(source) as f:
            text = f.read()
        if source.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise OverlapArgumentError(f"{where}: reading YAML needs PyYAML (pip install pyyaml), or write the "
                                           "file as JSON") from None
            try:
                content = yaml.safe_load(text)
            except yaml.YAMLError as error:
                raise OverlapArgumentError(f"{where}: not valid YAML: {error}") from None
        else:
            try:
                content = json.loads(text)
            except json.JSONDecodeError as error:
                raise OverlapArgumentError(f"{where}: not valid JSON ({error}); a .yaml / .yml name reads YAML") from None
    if content is None:
        content = {}
    if not isinstance(content, Mapping):
        raise OverlapArgumentError(f"{where}: expected a mapping keyed by {SECTIONS}, got {type(content).__name__}")
    checked = {}
    for section, fields in content.items():
        if section not in SECTIONS:
            raise OverlapArgumentError(f"{where}: unknown key {section!r}; expected keys from {SECTIONS}")
        if not isinstance(fields, Mapping):
            raise OverlapArgumentError(f"{where}: {section!r} must map field names to values, got "
                                       f"{type(fields).__name__}")
        allowed = LAYER_SWITCHES if section == "layers" else CONFIG_FIELDS
        for key, value in fields.items():
            if key not in allowed:
                raise OverlapArgumentError(f"{where}: unknown key {section}.{key}; expected one of {allowed}")
            if section == "layers" and not isinstance(value, bool):
                raise OverlapArgumentError(f"{where}: {section}.{key}={value!r}: expected true or false")
        if section != "layers":
            try:
                OverlapConfig(**fields)
            except ValueError as error:
                raise OverlapArgumentError(f"{where}: {section}: {error}") from None
        checked[section] = dict(fields)
    return checked
