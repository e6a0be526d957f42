import unittest

from minilib import durations


class TestParseDuration(unittest.TestCase):
    def test_hours_minutes(self):
        self.assertEqual(durations.parse_duration("1h30m"), 5400)

    def test_all_units(self):
        self.assertEqual(durations.parse_duration("1w2d3h4m5s"), 604800 + 2 * 86400 + 3 * 3600
                         + 4 * 60 + 5)

    def test_spaces_and_case(self):
        self.assertEqual(durations.parse_duration(" 2D 4H "), 2 * 86400 + 4 * 3600)

    def test_seconds(self):
        self.assertEqual(durations.parse_duration("90s"), 90)

    def test_empty(self):
        with self.assertRaises(ValueError):
            durations.parse_duration("  ")

    def test_out_of_order(self):
        with self.assertRaises(ValueError):
            durations.parse_duration("5m1h")

    def test_repeated_unit(self):
        with self.assertRaises(ValueError):
            durations.parse_duration("1m2m")

    def test_garbage_inside(self):
        with self.assertRaises(ValueError):
            durations.parse_duration("1hx2m")

    def test_trailing_garbage(self):
        with self.assertRaises(ValueError):
            durations.parse_duration("1h30")


class TestFormatDuration(unittest.TestCase):
    def test_hours_minutes(self):
        self.assertEqual(durations.format_duration(5400), "1h 30m")

    def test_zero(self):
        self.assertEqual(durations.format_duration(0), "0s")

    def test_skips_zero_units(self):
        self.assertEqual(durations.format_duration(86401), "1d 1s")

    def test_weeks(self):
        self.assertEqual(durations.format_duration(604800 * 2 + 60), "2w 1m")

    def test_negative(self):
        with self.assertRaises(ValueError):
            durations.format_duration(-1)

    def test_round_trip(self):
        for seconds in (1, 59, 61, 3599, 3601, 90061, 1209600):
            text = durations.format_duration(seconds)
            self.assertEqual(durations.parse_duration(text), seconds, text)


class TestCalendar(unittest.TestCase):
    def test_leap_years(self):
        self.assertTrue(durations.is_leap_year(2024))
        self.assertTrue(durations.is_leap_year(2000))
        self.assertFalse(durations.is_leap_year(1900))
        self.assertFalse(durations.is_leap_year(2023))

    def test_days_in_month(self):
        self.assertEqual([durations.days_in_month(2023, m) for m in range(1, 13)],
                         [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31])

    def test_february_leap(self):
        self.assertEqual(durations.days_in_month(2024, 2), 29)

    def test_bad_month(self):
        for month in (0, 13):
            with self.assertRaises(ValueError):
                durations.days_in_month(2024, month)

    def test_day_of_year(self):
        self.assertEqual(durations.day_of_year(2023, 1, 1), 1)
        self.assertEqual(durations.day_of_year(2023, 3, 1), 60)
        self.assertEqual(durations.day_of_year(2024, 12, 31), 366)


class TestParseDate(unittest.TestCase):
    def test_valid(self):
        self.assertEqual(durations.parse_date("2024-02-29"), (2024, 2, 29))

    def test_strips(self):
        self.assertEqual(durations.parse_date(" 2023-12-31\n"), (2023, 12, 31))

    def test_last_day_of_month(self):
        self.assertEqual(durations.parse_date("2023-04-30"), (2023, 4, 30))

    def test_first_day(self):
        self.assertEqual(durations.parse_date("2023-01-01"), (2023, 1, 1))

    def test_not_leap(self):
        with self.assertRaises(ValueError):
            durations.parse_date("2023-02-29")

    def test_bad_month(self):
        with self.assertRaises(ValueError):
            durations.parse_date("2023-13-01")

    def test_day_zero(self):
        with self.assertRaises(ValueError):
            durations.parse_date("2023-05-00")

    def test_bad_format(self):
        for text in ("2023/01/01", "2023-01", "2023-aa-01", "2023-01-01-01"):
            with self.assertRaises(ValueError):
                durations.parse_date(text)


class TestAddDays(unittest.TestCase):
    def test_same_month(self):
        self.assertEqual(durations.add_days((2023, 5, 10), 5), (2023, 5, 15))

    def test_month_end(self):
        self.assertEqual(durations.add_days((2023, 1, 31), 1), (2023, 2, 1))

    def test_leap_day(self):
        self.assertEqual(durations.add_days((2024, 2, 28), 1), (2024, 2, 29))

    def test_year_end(self):
        self.assertEqual(durations.add_days((2023, 12, 31), 1), (2024, 1, 1))

    def test_many_days(self):
        self.assertEqual(durations.add_days((2023, 1, 1), 365), (2024, 1, 1))

    def test_backwards(self):
        self.assertEqual(durations.add_days((2024, 3, 1), -1), (2024, 2, 29))

    def test_backwards_year(self):
        self.assertEqual(durations.add_days((2024, 1, 1), -1), (2023, 12, 31))

    def test_zero(self):
        self.assertEqual(durations.add_days((2023, 6, 30), 0), (2023, 6, 30))
