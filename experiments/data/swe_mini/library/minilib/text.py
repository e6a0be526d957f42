"""Text utilities: slugs, case conversion, wrapping, truncation and word counts."""

import re

_NON_WORD = re.compile(r"[^a-z0-9]+")
_WORD = re.compile(r"[a-z']+")


def slugify(text, sep="-"):
    """Lower-cases `text` and joins its runs of ASCII letters and digits with `sep`.

    >>> slugify("Hello, World!")
    'hello-world'
    """
    words = [w for w in _NON_WORD.split(text.lower()) if w]
    return sep.join(words)


def camel_to_snake(name):
    """'parseHTTPResponse' -> 'parse_http_response'; an acronym stays one word."""
    out = []
    for i, ch in enumerate(name):
        if ch.isupper():
            prev_lower = i > 0 and name[i - 1].islower()
            next_lower = i + 1 < len(name) and name[i + 1].islower()
            if i > 0 and (prev_lower or (next_lower and name[i - 1].isupper())):
                out.append("_")
            out.append(ch.lower())
        else:
            out.append(ch)
    return "".join(out)


def snake_to_camel(name, upper_first=False):
    """'parse_http_response' -> 'parseHttpResponse' ('ParseHttpResponse' with `upper_first`)."""
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0].lower()
    return head + "".join(p.capitalize() for p in parts[1:])


def truncate(text, width, suffix="..."):
    """`text` cut to at most `width` characters, ending with `suffix` when it was cut."""
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    if len(text) <= width:
        return text
    if width <= len(suffix):
        return suffix[:width]
    return text[: width - len(suffix)] + suffix


def wrap(text, width):
    """Greedy word wrap into lines of at most `width` characters; a longer word stands alone."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    lines = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def center(text, width, fill=" "):
    """`text` centred in `width` columns; an odd extra column goes to the right."""
    if len(fill) != 1:
        raise ValueError(f"fill must be one character, got {fill!r}")
    total = width - len(text)
    if total <= 0:
        return text
    left = total // 2
    right = total - left
    return fill * left + text + fill * right


def count_words(text):
    """{word: occurrences} of the lower-cased words of `text`, in order of first appearance."""
    counts = {}
    for word in _WORD.findall(text.lower()):
        word = word.strip("'")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def is_palindrome(text):
    """Whether the letters and digits of `text` read the same backwards, ignoring case."""
    chars = [c.lower() for c in text if c.isalnum()]
    i, j = 0, len(chars) - 1
    while i < j:
        if chars[i] != chars[j]:
            return False
        i += 1
        j -= 1
    return True
