"""Durations like '1h30m' and calendar dates as (year, month, day) tuples."""

import re

_UNITS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([wdhms])")
_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def parse_duration(text):
    """Seconds in a duration such as '1h30m' or '2d 4h'.

    Units are w, d, h, m and s; each appears at most once, largest first. Spaces are ignored.
    """
    text = text.replace(" ", "").lower()
    if not text:
        raise ValueError("empty duration")
    order = list(_UNITS)
    total = 0
    pos = 0
    last_rank = -1
    for match in _PART.finditer(text):
        if match.start() != pos:
            raise ValueError(f"bad duration {text!r} at position {pos}")
        unit = match.group(2)
        rank = order.index(unit)
        if rank <= last_rank:
            raise ValueError(f"unit {unit!r} repeated or out of order in {text!r}")
        last_rank = rank
        total += int(match.group(1)) * _UNITS[unit]
        pos = match.end()
    if pos != len(text):
        raise ValueError(f"bad duration {text!r} at position {pos}")
    return total


def format_duration(seconds):
    """'1h 30m' for 5400 seconds, '0s' for 0; the inverse of `parse_duration`."""
    if seconds < 0:
        raise ValueError(f"negative duration {seconds}")
    if seconds == 0:
        return "0s"
    parts = []
    for unit, size in _UNITS.items():
        count, seconds = divmod(seconds, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts)


def is_leap_year(year):
    """Gregorian leap years: every 4th, except centuries not divisible by 400."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    """The number of days of `month` (1-12) in `year`."""
    if not 1 <= month <= 12:
        raise ValueError(f"month {month} out of range 1-12")
    if month == 2 and is_leap_year(year):
        return 29
    return _DAYS[month - 1]


def parse_date(text):
    """(year, month, day) from 'YYYY-MM-DD'; an impossible date raises ValueError."""
    parts = text.strip().split("-")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a YYYY-MM-DD date: {text!r}")
    year, month, day = (int(p) for p in parts)
    if not 1 <= month <= 12:
        raise ValueError(f"month {month} out of range 1-12")
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"day {day} out of range for {year}-{month:02d}")
    return (year, month, day)


def day_of_year(year, month, day):
    """1 for January 1st, 365 (366 in leap years) for December 31st."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def add_days(date, days):
    """The (year, month, day) `days` after `date`; a negative `days` goes back."""
    year, month, day = date
    day += days
    while day > days_in_month(year, month):
        day -= days_in_month(year, month)
        month += 1
        if month > 12:
            month = 1
            year += 1
    while day < 1:
        month -= 1
        if month < 1:
            month = 12
            year -= 1
        day += days_in_month(year, month)
    return (year, month, day)
