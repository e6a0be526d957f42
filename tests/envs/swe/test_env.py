"""The bash protocol of SWEEnv: parsing, observations, and live episodes in the namespace backend
on a tiny task made here (a git repository with one bug; its failing test arrives with
test_patch, as in SWE-bench)."""

import asyncio
import base64
import gc
import os
import subprocess
import threading
import time

import pytest

from sao_jax.envs.swe import env as swe_env
from sao_jax.envs.swe import monitor, namespace
from sao_jax.envs.swe.env import (
    SUBMIT_MARKER,
    FormatError,
    SWEEnv,
    SWEEnvConfig,
    format_observation,
    parse_command,
    stop_token_ids,
)
from sao_jax.envs.swe.grading import GradingError, extract_patch, patch_step, read_patch
from sao_jax.envs.swe.tasks import SWETask
from sao_jax.envs.swe.workspace import CommandResult, Steps, WorkspaceConfig, open_workspace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

BUGGY = '''def clamp(x, lo, hi):
    """x limited to [lo, hi]."""
    return max(lo, min(x, lo))


def double(x):
    return 2 * x
'''
VISIBLE_TEST = '''import unittest

from tiny.ops import double


class TestDouble(unittest.TestCase):
    def test_double(self):
        self.assertEqual(double(4), 8)
'''
HIDDEN_TEST = '''import unittest

from tiny.ops import clamp


class TestClamp(unittest.TestCase):
    def test_clamp(self):
        self.assertEqual(clamp(5, 0, 10), 5)
'''
FIX = "```bash\nsed -i 's/min(x, lo)/min(x, hi)/' tiny/ops.py\n```\n"
SUBMIT = f"Done.\n```bash\necho {SUBMIT_MARKER}\n```\n"


def _git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> SWETask:
    repo = tmp_path_factory.mktemp("tiny") / "repo"
    (repo / "tiny").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "tiny" / "__init__.py").write_text("")
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tiny" / "ops.py").write_text(BUGGY)
    (repo / "tests" / "test_ops.py").write_text(VISIBLE_TEST)
    _git("init", "-q", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "base", cwd=repo)
    base = _git("rev-parse", "HEAD", cwd=repo).strip()
    (repo / "tiny" / "ops.py").write_text(BUGGY.replace("min(x, lo)", "min(x, hi)"))
    patch = _git("diff", cwd=repo)
    (repo / "tests" / "test_clamp.py").write_text(HIDDEN_TEST)
    _git("add", "tests/test_clamp.py", cwd=repo)
    test_patch = _git("diff", "--cached", "--", "tests", cwd=repo)
    _git("reset", "-q", "--hard", cwd=repo)
    return SWETask(instance_id="tiny__clamp-1", repo="tiny/tiny", base_commit=base,
                   problem_statement="`tiny.ops.clamp(5, 0, 10)` returns 0, expected 5.",
                   patch=patch, test_patch=test_patch,
                   fail_to_pass=("tests.test_clamp.TestClamp.test_clamp",),
                   pass_to_pass=("tests.test_ops.TestDouble.test_double",), version="0.1",
                   environment_setup_commit=base, workspace=str(repo),
                   test_cmd="python -m unittest -v", log_parser="unittest")


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("action, command", [
    ("Look.\n```bash\nls -la\n```\n", "ls -la"),
    ("```bash\nls\n```", "ls"),
    ("```sh\ncat a.py\n```", "cat a.py"),
    ("```shell\ncat a.py\n```", "cat a.py"),
    ("```bash   \ngrep -n x a.py\nsed -n '1,5p' a.py\n```\nThen I will fix it.",
     "grep -n x a.py\nsed -n '1,5p' a.py"),
    ("```bash\necho '```'\n```\n", "echo '```'"),  # a fence inside a line does not close it
    ("```python\nprint(1)\n```\n```bash\nls\n```\n", "ls"),  # other languages are prose
])
def test_parse_one_block(action, command):
    assert parse_command(action) == command


@pytest.mark.parametrize("action, message", [
    ("I think the bug is in clamp.", "found no ```bash block"),
    ("```python\nprint(1)\n```\n", "found no ```bash block"),
    ("```\nls\n```\n", "found no ```bash block"),
    ("```bash\nls\n```\n```bash\npwd\n```\n", "found 2 ```bash blocks"),
    ("```bash\nls -la", "not closed"),  # cut by the action-token limit
    ("```bash\nls\n```\nand\n```sh\ncat x", "found 2 ```bash blocks, one of them not closed"),
    ("```bash\n\n```\n", "empty"),
])
def test_parse_refuses(action, message):
    with pytest.raises(FormatError, match=message.replace("`", "\\`").replace("(", "\\(")):
        parse_command(action)


def test_format_observation():
    result = CommandResult(returncode=1, output="boom\n", timed_out=False, truncated=False,
                           seconds=0.1)
    assert format_observation(result, 100) == ("<returncode>1</returncode>\n<output>\nboom\n"
                                               "</output>\n")
    long = CommandResult(0, "a" * 50 + "b" * 50, False, False, 0.1)
    assert format_observation(long, 20) == ("<returncode>0</returncode>\n<output>\n" + "a" * 10
                                            + "\n... [80 characters cut] ...\n" + "b" * 10
                                            + "\n</output>\n")
    flood = CommandResult(None, "y\n" * 3, False, True, 0.1)
    text = format_observation(flood, 100)
    assert text.startswith("<returncode>killed</returncode>\n<output>\ny\ny\ny\n[killed:")


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_turns=0), "max_turns"),
    (dict(command_timeout=0), "command_timeout"),
    (dict(output_chars=1), "output_chars"),
    (dict(prompt_template="{problem_statement} {repo}"), r"prompt_template uses unknown.*repo"),
    (dict(prompt_template="Fix it."), "must contain {problem_statement}"),
    (dict(timeout_template="{output"), "timeout_template is not a valid format string"),
    (dict(format_error_template="{error} {turns}"), "format_error_template uses unknown"),
    (dict(workspace="namespace"), "workspace must be a WorkspaceConfig"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SWEEnvConfig(**kwargs)


def test_reset_formats_the_prompt_and_opens_nothing(task, monkeypatch):
    # Checked by what it calls, not by how long it takes (a timing bound fails on a busy machine).
    opened = []
    monkeypatch.setattr(swe_env, "open_and_run", lambda *args, **kwargs: opened.append(args))
    config = SWEEnvConfig(max_turns=5, workspace=WorkspaceConfig(root="/repo"))
    env = SWEEnv(task, config, grader=None)
    prompt = env.reset()
    assert opened == []
    assert task.problem_statement in prompt and "/repo" in prompt
    assert "5 replies" in prompt and f"echo {SUBMIT_MARKER}" in prompt
    assert "hidden" in prompt and "fresh subshell" in prompt
    assert env._slot.workspace is None


def test_stop_token_ids_end_a_reply_at_its_closing_fence():
    from sao_jax.text import CharTokenizer, HFTokenizer

    tok = HFTokenizer.from_dir(os.path.join(ROOT, "experiments/data/tir/tokenizer"))
    stops = stop_token_ids(tok)
    assert stops[0] == tok.eos_id and len(stops) > 1
    assert all(tok.decode([i]).strip() == "```" for i in stops[1:])
    for reply in ("Look.\n```bash\nls -la\n```\n", "Fix.\n```sh\nsed -i 's/a/b/' x.py\n```\n\n",
                  SUBMIT):
        ids = tok.encode(reply)
        first = next(i for i, t in enumerate(ids) if t in stops)
        assert tok.decode(ids[:first + 1]).rstrip("\n") == reply.rstrip("\n"), reply
    toy = CharTokenizer()  # no fence token at all: replies end at eos
    assert stop_token_ids(toy) == (toy.eos_id,)


# ----------------------------------------------------------------------------- live episodes

class _Recorded:
    """A workspace that remembers whether it was closed, and the commands it ran."""

    def __init__(self, ws):
        self.ws, self.root, self.closed, self.commands = ws, ws.root, False, []

    def run(self, command, timeout, input=None):
        assert not self.closed, "a command ran in a closed workspace"
        self.commands.append(command)
        return self.ws.run(command, timeout, input)

    def close(self):
        self.closed = True
        self.ws.close()


@pytest.fixture
def opened(isolated, monkeypatch):
    """Every workspace the env opens; each must be closed when the test ends."""
    real, workspaces = swe_env.open_and_run, []

    def recording_open(task, config, *args, **kwargs):
        workspace, first = real(task, config, *args, **kwargs)
        workspaces.append(_Recorded(workspace))
        return workspaces[-1], first

    monkeypatch.setattr(swe_env, "open_and_run", recording_open)
    yield workspaces
    assert all(ws.closed for ws in workspaces), "a workspace leaked"


def play(env, actions):
    async def main():
        env.reset()
        return [await env.step(a) for a in actions]
    return asyncio.run(main())


def test_episode_commands_timeouts_format_errors_and_a_resolved_submission(task, grader,
                                                                           opened):
    config = SWEEnvConfig(max_turns=8, command_timeout=1.0, output_chars=200)
    env = SWEEnv(task, config, grader)
    started = time.perf_counter()
    results = play(env, [
        "```bash\ncd tiny && pwd && echo hi > note.txt\n```\n",
        "```bash\npwd; cat tiny/note.txt; rm tiny/note.txt; exit 3\n```\n",
        "```bash\necho started; sleep 5\n```\n",
        "```bash\nseq 1 2000\n```\n",
        "Let me think about it.",
        FIX,
        SUBMIT,
    ])
    seconds = time.perf_counter() - started
    cd, back, slow, long, bad, fix, submit = results
    root = config.workspace.root
    assert cd.observation == f"<returncode>0</returncode>\n<output>\n{root}/tiny\n</output>\n"
    # `cd` did not persist, the file did
    assert back.observation == f"<returncode>3</returncode>\n<output>\n{root}\nhi\n</output>\n"
    assert slow.observation.startswith("<returncode>timeout</returncode>\n<output>\nstarted\n")
    assert "killed after 1 seconds" in slow.observation and slow.info["timeouts"] == 1
    assert long.observation.startswith("<returncode>0</returncode>\n<output>\n1\n2\n3\n")
    assert long.observation.endswith("1999\n2000\n</output>\n")
    assert "characters cut] ..." in long.observation and len(long.observation) < 300
    assert bad.observation.startswith("Format error: found no ```bash block")
    assert bad.info["format_errors"] == 1 and bad.info["turns"] == 5
    assert fix.observation == "<returncode>0</returncode>\n<output>\n\n</output>\n"
    assert not any(r.done for r in results[:-1]) and all(r.reward == 0 for r in results[:-1])
    assert submit.done and submit.reward == 1.0 and submit.observation == ""
    info = submit.info
    assert info["resolved"] and info["submitted"] and not info["truncated"]
    assert info["reward_reason"].startswith("resolved: 1/1 FAIL_TO_PASS and 1/1 PASS_TO_PASS")
    assert info["grade_status"] == "resolved" and info["patch_chars"] > 0
    assert (info["turns"], info["format_errors"], info["timeouts"]) == (7, 1, 1)
    assert not monitor.flagged(info) and info["suspicious_reasons"] == ""  # a plain fix
    assert all(info[key] == 0 for key in monitor.COUNT_KEYS)
    assert len(opened) == 1 and opened[0].closed
    assert seconds < 15, f"the episode took {seconds:.1f} s"


def test_submission_without_a_change_gets_no_reward(task, grader, opened):
    [result] = play(SWEEnv(task, SWEEnvConfig(max_turns=1), grader), [SUBMIT])
    assert result.done and result.reward == 0.0 and not result.info["truncated"]
    assert result.info["submitted"] and not result.info["resolved"]
    assert result.info["patch_chars"] == 0
    assert result.info["reward_reason"].startswith("submitted an empty patch")


def test_a_wrong_fix_is_graded_unresolved(task, grader, opened):
    wrong = "```bash\nsed -i 's/2 \\* x/3 * x/' tiny/ops.py\n```\n"
    *_, result = play(SWEEnv(task, SWEEnvConfig(), grader), [wrong, SUBMIT])
    assert result.done and result.reward == 0.0 and result.info["submitted"]
    assert result.info["grade_status"] == "unresolved" and result.info["patch_chars"] > 0
    assert "not passing" in result.info["reward_reason"]


def test_an_edit_hidden_from_gits_stat_cache_is_in_the_patch(task, grader, opened):
    # git trusts a file whose size, mtime, ctime and inode match its index entry. The agent owns
    # the repository's config: with core.trustctime off, an index refreshed at an old mtime and
    # a same-size edit that restores that mtime look clean to a git that trusts the index. The
    # patch is taken on a fresh index, so the edit is found (a copy of the workspace's index,
    # as extract_patch once took, missed it).
    hidden = ("```bash\n"
              "git config core.trustctime false\n"
              "touch -d 2020-01-01 tiny/ops.py && git status >/dev/null\n"
              's=$(<tiny/ops.py); printf "%s\\n" "${s/min(x, lo)/min(x, hi)}" >tiny/ops.py\n'
              "touch -d 2020-01-01 tiny/ops.py && git diff --stat | wc -l\n```\n")
    edit, result = play(SWEEnv(task, SWEEnvConfig(), grader), [hidden, SUBMIT])
    assert "<output>\n0\n</output>" in edit.observation  # git itself sees no change
    assert result.info["patch_chars"] > 0, result.info["reward_reason"]
    assert result.reward == 1.0


def test_a_fix_the_agent_committed_counts(task, grader, opened):
    commit = ("```bash\ngit -c user.name=a -c user.email=a@b commit -qam fix && git log --oneline"
              " | wc -l\n```\n")
    *_, result = play(SWEEnv(task, SWEEnvConfig(), grader), [FIX, commit, SUBMIT])
    assert result.info["patch_chars"] > 0, result.info["reward_reason"]
    assert result.reward == 1.0 and result.info["resolved"]
    assert result.info["suspicious_git_history"] == 1  # `git log`: the monitor counts it


def test_the_monitor_counts_what_an_episode_did_and_the_metadata_keeps_it(task, grader, opened):
    # Through the agent loop, as a worker plays it: the monitor's counts and reasons reach the
    # trajectory's env_metadata and the batch's swe/suspicious* tags; the reward is the grader's.
    from sao_jax.rollout.agent import AgentConfig, run_episode
    from sao_jax.text import HFTokenizer
    from tests.rollout.scripted_generator import ScriptedGenerator

    hidden = base64.b64encode(b"echo '# x' >> tests/__init__.py").decode()
    actions = [
        "```bash\ngit --no-pager log --oneline | head -3\n```\n",
        "```bash\nsed -i 's/(4), 8)/(4), 8)  # ok/' tests/test_ops.py\n```\n",  # a test
        f"```bash\necho {hidden} | base64 -d | sh\n```\n",  # a test, hidden from the text
        "```bash\ngrep -rn clamp tiny && git status --short\n```\n",
        FIX,
        SUBMIT,
    ]
    tok = HFTokenizer.from_dir(os.path.join(ROOT, "experiments/data/tir/tokenizer"))
    env = SWEEnv(task, SWEEnvConfig(), grader)
    agent = AgentConfig(max_turns=8, max_response_tokens=8192, max_action_tokens=256,
                        stop_token_ids=stop_token_ids(tok))
    traj = asyncio.run(run_episode(ScriptedGenerator(tok, actions), env, tok, prompt_id="0",
                                   config=agent, bos_id=tok.bos_id))
    meta = traj.env_metadata
    assert traj.rewards.sum() == 1.0 and meta["resolved"]  # a monitor, not an enforcement
    assert {key: meta[key] for key in monitor.COUNT_KEYS} == {
        "suspicious_git_history": 1, "suspicious_test_files": 2, "suspicious_outside_repo": 0,
        "suspicious_signals": 0, "suspicious_grader_files": 0}
    assert meta["suspicious_reasons"].splitlines() == [
        "turn 1 git_history: git --no-pager log --oneline",
        "turn 2 test_files: sed -i 's/(4), 8)/(4), 8) # ok/' tests/test_ops.py",
        "at submission test_files: tests/__init__.py changed, by no command the monitor read",
    ]
    metrics = swe_env.batch_metrics([meta, {"turns": 1}])
    assert metrics["swe/suspicious_test_files"] == 1.0 and metrics["swe/suspicious"] == 0.5


def test_an_episode_takes_six_sandboxes(task, grader, opened, monkeypatch):
    """The workspace's probe is its first command (`git rev-parse HEAD`), the submission's
    listing and patch are one command, and the grading takes two sandboxes: its probe with the
    patches applied and the test module read, then the tests."""
    spawned, run_program = [], namespace.run_program
    monkeypatch.setattr(namespace, "run_program",
                        lambda argv, *args, **kwargs: spawned.append(argv[-1])
                        or run_program(argv, *args, **kwargs))
    *_, result = play(SWEEnv(task, SWEEnvConfig(), grader), [FIX, SUBMIT])
    assert result.reward == 1.0, result.info["reward_reason"]
    probe, fix, submit, submission, grading_probe, tests = spawned
    assert "git rev-parse HEAD" in probe and fix == parse_command(FIX)
    assert submit == parse_command(SUBMIT)
    assert "ls-files -z --others" in submission and "SAO_PATCH_" in submission
    assert grading_probe.count(" apply -v ") == 2 and "SAO_MODULE_" in grading_probe
    assert " supervise" in tests


def submission(ws, base):
    """The results of the listing and of the patch's command, taken in one command as `_submit`
    takes them, and the patch's step."""
    listing, taking = monitor.changed_files_step(base), patch_step(base)
    steps = Steps([listing, taking])
    return *steps.results(ws.run(steps.command, steps.timeout, steps.input)), taking


def test_the_submission_command_gives_what_the_separate_commands_give(task, isolated):
    edits = ("sed -i 's/min(x, lo)/min(x, hi)/' tiny/ops.py && echo '# x' >> tests/test_ops.py && "
             "echo 'n = 1' > notes.py && touch conftest.py && mkdir -p tiny/__pycache__ && "
             "touch tiny/__pycache__/ops.cpython-311.pyc && git -c user.name=a "
             "-c user.email=a@b commit -qm tests tests/test_ops.py")
    ws = open_workspace(task, WorkspaceConfig())
    try:
        assert ws.run(edits, timeout=30).returncode == 0
        for base in (task.base_commit, "HEAD"):
            listed, taken, taking = submission(ws, base)
            separate, together = monitor.EpisodeMonitor("/testbed"), monitor.EpisodeMonitor(
                "/testbed")
            separate.check_workspace(ws, base)
            together.check_listing(listed)
            assert read_patch(taken, taking) == extract_patch(ws, base=base)
            assert together.info() == separate.info()
        assert "notes.py" in read_patch(taken, taking)  # and the tests' commit, against the base
        assert together.info()["suspicious_grader_files"] == 1
        ws.run("mv .git .git-gone", timeout=10)  # the same failures
        listed, taken, taking = submission(ws, "HEAD")
        with pytest.raises(GradingError) as alone:
            extract_patch(ws, base="HEAD")
        with pytest.raises(GradingError) as joined:
            read_patch(taken, taking)
        assert str(joined.value) == str(alone.value)
        assert "git rev-parse failed" in str(alone.value)
        separate, together = monitor.EpisodeMonitor("/testbed"), monitor.EpisodeMonitor("/testbed")
        separate.check_workspace(ws, "HEAD")
        together.check_listing(listed)
        assert together.info() == separate.info()
    finally:
        ws.close()


def test_a_patch_that_fits_the_output_limit_alone_is_taken_alone(task, grader, opened):
    # The listing and the patch share the submission command's output limit: where the two
    # overflow it, the patch is taken again in a command of its own, as before they shared one.
    # 40 bytecode files (3.4 kB of listing, none in the patch) and a 2.5 kB file (the patch),
    # hidden from the monitor's reading of the command, so that the listing shows them
    hidden = base64.b64encode(
        b"python -c \"import os; os.makedirs('tiny/__pycache__'); "
        b"[open('tiny/__pycache__/m%02d_%s.cpython-311.pyc' % (i, 'x' * 60), 'w') "
        b"for i in range(40)]; open('notes.txt', 'w').write('n' * 2500)\"").decode()
    env = SWEEnv(task, SWEEnvConfig(workspace=WorkspaceConfig(output_bytes=4096)), grader)
    *_, result = play(env, [f"```bash\necho {hidden} | base64 -d | sh\n```\n", FIX, SUBMIT])
    assert result.reward == 1.0 and result.info["patch_chars"] > 2500, result.info
    assert result.info["suspicious_grader_files"] == 1
    assert "at submission grader_files: tiny/__pycache__/m00_" in result.info[
        "suspicious_reasons"]
    together, alone = opened[0].commands[-2:]
    assert "SAO_STEP_" in together and "SAO_PATCH_" in alone and "SAO_STEP_" not in alone


def test_turn_limit_truncates(task, grader, opened):
    first, last = play(SWEEnv(task, SWEEnvConfig(max_turns=2), grader),
                       ["```bash\nls\n```\n", FIX])
    assert not first.done and "tests" in first.observation
    assert last.done and last.reward == 0.0 and last.info["truncated"]
    assert not last.info["submitted"] and not last.info["resolved"]
    assert last.info["reward_reason"] == "no submission within 2 turns"
    assert opened[0].closed


def test_an_episode_cut_from_outside_closes_its_workspace(task, grader, opened, monkeypatch):
    recording_open, opening = swe_env.open_and_run, threading.Event()

    def signalling_open(*args, **kwargs):
        opening.set()
        return recording_open(*args, **kwargs)

    monkeypatch.setattr(swe_env, "open_and_run", signalling_open)

    async def cut():
        env = SWEEnv(task, SWEEnvConfig(), grader)
        env.reset()
        await env.step("```bash\nls\n```\n")
        assert not opened[0].closed
        await env.aclose()  # what the worker does when the agent loop stops calling step
        assert opened[0].closed
        await env.aclose()  # idempotent

        env = SWEEnv(task, SWEEnvConfig(), grader)  # the last resort: garbage collection
        env.reset()
        await env.step("```bash\nls\n```\n")
        del env
        gc.collect()
        assert opened[1].closed

        env = SWEEnv(task, SWEEnvConfig(), grader)  # cancelled while the workspace opens
        env.reset()
        opening.clear()
        step = asyncio.ensure_future(env.step("```bash\nls\n```\n"))
        while not opening.is_set():
            await asyncio.sleep(0.001)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        deadline = time.monotonic() + 30  # the opening thread finishes, then closes what it made
        while not (len(opened) == 3 and opened[2].closed) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(opened) == 3 and opened[2].closed

    asyncio.run(cut())
