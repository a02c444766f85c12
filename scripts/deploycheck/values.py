"""Small readers of the values found in the deployment files, shared by the checks."""

import re


def short(mapping):
    """{a: b, c: d} as it would be written in YAML flow style, for messages."""
    if not isinstance(mapping, dict):
        return repr(mapping)
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


def dig(data, *keys, default=None):
    for key in keys:
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return default
    return data


def env_dict(environment):
    """A compose `environment:` (mapping or list of KEY=value) as a dict."""
    if isinstance(environment, dict):
        return {str(k): ("" if v is None else str(v)) for k, v in environment.items()}
    result = {}
    for item in environment or []:
        key, _, value = str(item).partition("=")
        result[key] = value
    return result


def compose_default(value):
    """A Compose value as `docker compose up` reads it when no variable is set: ${NAME:-default}
    and ${NAME-default} give the default, ${NAME} and $NAME nothing, $$ a $."""
    pattern = r"\$\$|\$\{\w+(?::?-(?P<default>[^}]*))?\}|\$\w+"
    return re.sub(
        pattern, lambda m: "$" if m.group(0) == "$$" else (m.group("default") or ""), str(value)
    )


def seconds(duration):
    """Compose/Go durations ("30s", "1m30s", "500ms", 10) in seconds; None if unreadable."""
    if isinstance(duration, (int, float)):
        return float(duration)
    if not isinstance(duration, str):
        return None
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration.strip())
    if not parts or "".join(n + u for n, u in parts) != duration.strip():
        return None
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 0.000001}
    return sum(float(n) * scale[u] for n, u in parts)


def command_line(definition):
    """A compose service's command (a list) as one line, to look for options in."""
    return " ".join(map(str, definition.get("command") or []))


def matches(selector, labels):
    """Whether a Kubernetes selector (matchLabels) selects an object with these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
