"""Read MindFormers YAMLs as plain dicts (``base_config`` merged), the way MindFormerConfig reads them.

PyYAML reads ``1.e-6`` as a string; MindFormers reads it as a float. The loader
here adds that float form so values survive a load/dump round trip.
"""
import os
import re

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-3 / 1.e-3 as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+][0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _merge(base, override):
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def load_yaml(path):
    """The YAML at ``path`` with its ``base_config`` files (relative to it) merged underneath."""
    with open(path, encoding="utf-8") as handle:
        data = yaml.load(handle, Loader=_Loader) or {}
    bases = data.pop("base_config", None) or []
    merged = {}
    for base in [bases] if isinstance(bases, str) else bases:
        _merge(merged, load_yaml(os.path.join(os.path.dirname(os.path.abspath(path)), base)))
    return _merge(merged, data)


def dump_yaml(data, path):
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)
    return path
