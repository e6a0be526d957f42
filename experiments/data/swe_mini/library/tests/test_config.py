import unittest

from minilib import config

SAMPLE = """\
# global settings
name = demo
Debug: yes

[server]
host = example.org
port = 8080
; a comment
tags = a, b,, c

[empty]
"""


class TestParseIni(unittest.TestCase):
    def test_sections(self):
        got = config.parse_ini(SAMPLE)
        self.assertEqual(list(got), ["", "server", "empty"])
        self.assertEqual(got["server"], {"host": "example.org", "port": "8080",
                                         "tags": "a, b,, c"})

    def test_global_pairs_and_colon(self):
        got = config.parse_ini(SAMPLE)
        self.assertEqual(got[""], {"name": "demo", "debug": "yes"})

    def test_empty_section_kept(self):
        self.assertEqual(config.parse_ini(SAMPLE)["empty"], {})

    def test_no_global_section(self):
        self.assertEqual(config.parse_ini("[a]\nx=1\n"), {"a": {"x": "1"}})

    def test_repeated_key_and_section(self):
        got = config.parse_ini("[a]\nx = 1\n[b]\ny = 2\n[a]\nx = 3\n")
        self.assertEqual(got, {"a": {"x": "3"}, "b": {"y": "2"}})

    def test_value_with_equals(self):
        self.assertEqual(config.parse_ini("url = a=b")[""], {"url": "a=b"})

    def test_unclosed_header(self):
        with self.assertRaises(config.ConfigError):
            config.parse_ini("[a\nx = 1")

    def test_empty_header(self):
        with self.assertRaises(config.ConfigError):
            config.parse_ini("[ ]")

    def test_not_a_pair(self):
        with self.assertRaises(config.ConfigError) as ctx:
            config.parse_ini("x = 1\njust words\n")
        self.assertIn("line 2", str(ctx.exception))

    def test_empty_key(self):
        with self.assertRaises(config.ConfigError):
            config.parse_ini(" = 1")

    def test_config_error_is_value_error(self):
        self.assertTrue(issubclass(config.ConfigError, ValueError))


class TestValues(unittest.TestCase):
    def test_bools(self):
        for word in ("1", "yes", "TRUE", " on "):
            self.assertIs(config.parse_bool(word), True, word)
        for word in ("0", "No", "false", "off"):
            self.assertIs(config.parse_bool(word), False, word)

    def test_bad_bool(self):
        with self.assertRaises(ValueError):
            config.parse_bool("maybe")

    def test_list(self):
        self.assertEqual(config.parse_list(" a, b,, c "), ["a", "b", "c"])

    def test_list_sep(self):
        self.assertEqual(config.parse_list("a;b", sep=";"), ["a", "b"])


class TestGetTyped(unittest.TestCase):
    def setUp(self):
        self.sections = config.parse_ini(SAMPLE)

    def test_str(self):
        self.assertEqual(config.get_typed(self.sections, "server", "host"), "example.org")

    def test_int(self):
        self.assertEqual(config.get_typed(self.sections, "server", "port", int), 8080)

    def test_float(self):
        self.assertEqual(config.get_typed(self.sections, "server", "port", float), 8080.0)

    def test_bool(self):
        self.assertIs(config.get_typed(self.sections, "", "DEBUG", bool), True)

    def test_list(self):
        self.assertEqual(config.get_typed(self.sections, "server", "tags", list), ["a", "b", "c"])

    def test_default(self):
        self.assertEqual(config.get_typed(self.sections, "server", "missing", int, 7), 7)
        self.assertIsNone(config.get_typed(self.sections, "nope", "host"))

    def test_bad_kind(self):
        with self.assertRaises(TypeError):
            config.get_typed(self.sections, "server", "host", dict)


class TestDumpIni(unittest.TestCase):
    def test_dump(self):
        text = config.dump_ini({"b": {"x": "1"}, "": {"top": "y"}, "a": {"z": "2"}})
        self.assertEqual(text, "top = y\n\n[b]\nx = 1\n\n[a]\nz = 2\n")

    def test_dump_without_global(self):
        self.assertEqual(config.dump_ini({"a": {"k": "v"}}), "[a]\nk = v\n")

    def test_dump_empty(self):
        self.assertEqual(config.dump_ini({}), "")

    def test_round_trip(self):
        sections = config.parse_ini(SAMPLE)
        self.assertEqual(config.parse_ini(config.dump_ini(sections)), sections)
