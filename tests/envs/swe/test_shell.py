"""The monitor's bash lexer (`envs.swe.shell.lex`): what it splits, keeps and hands back to lex
again, and that no text makes it raise."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sao_jax.envs.swe.shell import lex


def words(text: str) -> list[list[str]]:
    return [c.words for c in lex(text).commands]


@pytest.mark.parametrize("text, expected", [
    ("git log -p", [["git", "log", "-p"]]),
    ("a && b || c; d | e & f", [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]),
    ("a\nb", [["a"], ["b"]]),
    ("(cd x; y)", [["cd", "x"], ["y"]]),
    ("echo 'a b' \"c d\" e\\ f", [["echo", "a b", "c d", "e f"]]),
    ("echo $'a\\tb'", [["echo", "a\tb"]]),
    ("echo \"x\\\"y\"", [["echo", 'x"y']]),
    ("echo a # git log\nls", [["echo", "a"], ["ls"]]),
    ("echo a#b", [["echo", "a#b"]]),
    ("ls \\\n -la", [["ls", "-la"]]),
    ("echo ${HOME}/x $V", [["echo", "${HOME}/x", "$V"]]),
])
def test_words(text, expected):
    assert words(text) == expected


def test_redirections_keep_their_targets_and_drop_file_descriptors():
    [command] = lex("cmd 2>/dev/null >out.txt >>log <in &>all").commands
    assert command.words == ["cmd"]
    assert [(op, target) for op, target, _ in command.redirects] == [
        (">", "/dev/null"), (">", "out.txt"), (">>", "log"), ("<", "in"), ("&>", "all")]


def test_heredoc_bodies_and_here_strings():
    text = "python - <<'EOF'\nimport os\nos.remove('tests/t.py')\nEOF\ncat <<<hello\n"
    first, second = lex(text).commands
    assert first.words == ["python", "-"]
    assert first.redirects == [["<<", "EOF", "import os\nos.remove('tests/t.py')\n"]]
    assert second.redirects == [["<<<", "hello", "hello"]]
    [tabbed] = lex("cat <<-END\n\tx\n\tEND\necho after").commands[:1]
    assert tabbed.redirects[0][2] == "\tx\n"
    assert words("cat <<-END\n\tx\n\tEND\necho after")[1] == ["echo", "after"]


def test_substitutions_are_kept_as_written_and_handed_back():
    lexed = lex("echo $(git log) `cat .git/HEAD` \"$(rm x)\" $((1 + 2)) <(ls .git)")
    assert lexed.commands[0].words == ["echo", "$(git log)", "`cat .git/HEAD`", "$(rm x)",
                                       "$((1 + 2))", "/dev/fd/63"]
    # arithmetic is not a command; the process substitution is
    assert lexed.nested == ["git log", "cat .git/HEAD", "rm x", "ls .git"]


def test_source_text_of_each_command():
    texts = [c.text for c in lex("git status && git log -1").commands]
    assert [t.rstrip() for t in texts] == ["git status", "git log -1"]


@pytest.mark.parametrize("text", ["echo 'unclosed", 'echo "unclosed', "echo $(unclosed",
                                  "cat <<EOF\nno end", "echo `x", "${", ">", "&&", "\\"])
def test_broken_text_ends_a_word_or_command(text):
    lex(text)  # never raises


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab $'\"`\\(){}<>|&;#\n\t-=")), max_size=40))
def test_never_raises(text):
    lexed = lex(text)
    assert all(isinstance(w, str) for c in lexed.commands for w in c.words)
