"""A small INI reader and writer: sections, `key = value` pairs, comments, typed getters."""

_TRUE = ("1", "yes", "true", "on")
_FALSE = ("0", "no", "false", "off")


class ConfigError(ValueError):
    """A line that is neither a section header, a pair, a comment nor blank."""


def parse_ini(text):
    """{section: {key: value}} from INI text.

    Pairs before the first section go to section ''. Keys are lower-cased, keys and values
    stripped; `key: value` works too. Lines starting with '#' or ';' are comments. A repeated key
    keeps its last value; a repeated section continues the first one.
    """
    sections = {"": {}}
    current = sections[""]
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise ConfigError(f"line {number}: unclosed section header {line!r}")
            name = line[1:-1].strip()
            if not name:
                raise ConfigError(f"line {number}: empty section name")
            current = sections.setdefault(name, {})
            continue
        key, sep, value = line.partition("=")
        if not sep:
            key, sep, value = line.partition(":")
        if not sep or not key.strip():
            raise ConfigError(f"line {number}: expected `key = value`, got {line!r}")
        current[key.strip().lower()] = value.strip()
    if not sections[""]:
        del sections[""]
    return sections


def parse_bool(value):
    """True for 1/yes/true/on, False for 0/no/false/off (any case); ValueError otherwise."""
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"not a boolean: {value!r}")


def parse_list(value, sep=","):
    """The non-empty stripped items of `value` split at `sep`."""
    return [item.strip() for item in value.split(sep) if item.strip()]


def get_typed(sections, section, key, kind=str, default=None):
    """sections[section][key] read as `kind` (str, int, float, bool or list), else `default`."""
    try:
        raw = sections[section][key.lower()]
    except KeyError:
        return default
    if kind is bool:
        return parse_bool(raw)
    if kind is list:
        return parse_list(raw)
    if kind in (int, float, str):
        return kind(raw)
    raise TypeError(f"unsupported kind {kind!r}")


def dump_ini(sections):
    """INI text for {section: {key: value}}, read back equal by `parse_ini`.

    Section '' is written first, without a header; a blank line separates sections.
    """
    lines = []
    for name, pairs in sorted(sections.items(), key=lambda item: item[0] != ""):
        if name:
            if lines:
                lines.append("")
            lines.append(f"[{name}]")
        for key, value in pairs.items():
            lines.append(f"{key} = {value}")
    if not lines:
        return ""
    return "\n".join(lines) + "\n"
