"""Read MindFormers YAMLs as plain dicts (``base_config`` merged), the way MindFormerConfig reads them.

PyYAML reads ``1.e-6`` as a string; MindFormers reads it as a float. The loader
here adds that float form so values survive a load/dump round trip.
"""
import os
import re

import yaml

from .errors import ConfigError


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
    """The YAML at ``path`` with its ``base_config`` files (relative to it) merged underneath. A file that is
    not YAML raises ConfigError naming its line and column."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(syntax_error_text(path, err)) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} cannot be read as a YAML file ({err.__class__.__name__}: {err}).") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is {type(data).__name__}, not a mapping of keys; start from a "
                          f"file in model_configs/.")
    bases = data.pop("base_config", None) or []
    merged = {}
    for base in [bases] if isinstance(bases, str) else bases:
        base_path = os.path.join(os.path.dirname(os.path.abspath(path)), base)
        if not os.path.isfile(base_path):
            raise ConfigError(f"{path}: its base_config {base!r} is not there ({os.path.normpath(base_path)}): a "
                              f"base_config is read relative to the YAML that names it, so copy that file beside "
                              f"this one, or write its path from here.")
        _merge(merged, load_yaml(base_path))
    return _merge(merged, data)


def syntax_error_text(path, err):
    """``path:LINE:COLUMN: <what YAML says>`` for a YAMLError (1-based, as editors count)."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = " ".join(str(part) for part in (getattr(err, "context", None), getattr(err, "problem", None))
                       if part) or str(err).splitlines()[0]
    return f"{where}: YAML syntax error: {problem}; fix the file at that line and column."


def dump_yaml(data, path):
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(data, handle, sort_keys=False)
    return path
