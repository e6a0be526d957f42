"""Builds swe_tiny: one-line bug fixes in small functions, a task family a 0.1M-parameter policy
can learn through the real SWE path (workspaces, hidden tests, the grader).

    python experiments/data/swe_tiny/make_tasks.py   # writes tasks.jsonl and repo.bundle here

The repository `tinyfix` holds one short function per file (`tinyfix/f000.py` ...); the family
(templates, the five mutation kinds, which files are held out) is `sao_jax.envs.swe.tiny`'s.
A task is one single-token mutation of one file,
kept only where some input tells the mutant from the original. The hidden test (the
`test_patch` adds `tests/test_fNNN.py`) checks four calls, at least one of which the bug breaks;
the problem statement shows one of those calls, what it gives and what it should give. Every
eleventh file (`f005`, `f016`, ...) is held out: its `HELD_OUT` tasks are the last rows of
tasks.jsonl, which a run holds out (`env.num_eval_prompts`), in files no training task touches,
so that the held-out rate measures fixing bugs of the known kinds in code the policy has not
seen, not recalling lines. (With the last files held out instead, f400-f439, the warm-started
policy resolved none of them: it had never written a path starting `f4`.)

Each row keeps, in `extra["mutation"]`: the kind, the file, the line number, the buggy and the
fixed line, and `decoys`: other one-token edits of the fixed line that the hidden test rejects
(plausible wrong fixes, for a teacher that makes mistakes: `envs.swe.expert.edit_actions`),
each checked, as the fix is, to be what the expert's sed substitution writes.

Deterministic (seed `SEED`, fixed git dates): rerunning writes the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))

from sao_jax.envs.swe.tiny import KINDS, PACKAGE, first_instances, held_out  # noqa: E402

SEED = 7
NUM_TASKS = 440
HELD_OUT = 40
GIT_DATE = "2026-12-05T12:00:00+00:00"


def git(*args: str, cwd: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent",
           "LANG": "C.UTF-8", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "swe-tiny", "GIT_AUTHOR_EMAIL": "swe-tiny@sao-jax.invalid",
           "GIT_COMMITTER_NAME": "swe-tiny", "GIT_COMMITTER_EMAIL": "swe-tiny@sao-jax.invalid",
           "GIT_AUTHOR_DATE": GIT_DATE, "GIT_COMMITTER_DATE": GIT_DATE}
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "init.templateDir=",
                           "-c", "core.abbrev=10", "-c", "pack.threads=1", *args], cwd=cwd,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def write(root: str, path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
    with open(os.path.join(root, path), "w", encoding="ascii") as f:
        f.write(text)


def build(instances: list[dict], workdir: str) -> list[dict]:
    """The repository (main: every function right; one commit per task on top), its bundle, and
    the task rows."""
    repo = os.path.join(workdir, "repo")
    os.makedirs(repo)
    git("init", "-q", "-b", "main", cwd=repo)
    write(repo, f"{PACKAGE}/__init__.py", "")
    write(repo, "tests/__init__.py", "")
    for inst in instances:
        write(repo, inst["file"], inst["source"])
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", "tinyfix 1.0", cwd=repo)
    pristine = git("rev-parse", "HEAD", cwd=repo).strip()
    rows = []
    for inst in instances:
        instance_id = f"sao-jax__swe-tiny-{inst['index']}"
        git("checkout", "-q", "--detach", pristine, cwd=repo)
        write(repo, inst["file"], inst["mutant"])
        git("commit", "-q", "-am", f"{instance_id}: {inst['mutation']['kind']} in {inst['file']}"
            f" line {inst['mutation']['line']}", cwd=repo)
        base = git("rev-parse", "HEAD", cwd=repo).strip()
        git("branch", instance_id, cwd=repo)
        patch = git("diff", "--no-color", base, pristine, cwd=repo)
        write(repo, f"tests/test_{inst['module']}.py", inst["test"])
        git("add", "-A", cwd=repo)
        test_patch = git("diff", "--no-color", "--cached", base, cwd=repo)
        git("reset", "-q", "--hard", base, cwd=repo)
        rows.append({
            "instance_id": instance_id, "repo": "sao-jax/swe-tiny", "base_commit": base,
            "problem_statement": inst["problem"], "patch": patch, "test_patch": test_patch,
            "FAIL_TO_PASS": [inst["test_id"]], "PASS_TO_PASS": [], "version": "1.0",
            "environment_setup_commit": pristine, "workspace": "repo.bundle",
            "test_cmd": f"python -m unittest -v tests.test_{inst['module']}",
            "log_parser": "unittest", "mutation": inst["mutation"], "template": inst["template"]})
    git("checkout", "-q", "main", cwd=repo)
    git("bundle", "create", "-q", os.path.join(workdir, "repo.bundle"), "--all", cwd=repo)
    return rows


def check_edits(rows: list[dict]) -> list[str]:
    """The expert's sed substitution (`envs.swe.expert.sed_substitution`) of every fix and decoy,
    run by sed on the buggy line, gives that line; decoys it cannot write are dropped."""
    from sao_jax.envs.swe.expert import sed_substitution

    problems = []
    for row in rows:
        mutation = row["mutation"]

        def sed_gives(target, buggy=mutation["buggy"]):
            try:
                script = sed_substitution(1, buggy, target)
            except ValueError:
                return False
            done = subprocess.run(["sed", script], input=buggy + "\n",
                                  capture_output=True, text=True)
            return done.stdout == target + "\n" and "'" not in script

        if not sed_gives(mutation["fixed"]):
            problems.append(f"{row['instance_id']}: no sed substitution makes the fix")
        mutation["decoys"] = [d for d in mutation["decoys"] if sed_gives(d)]
        if not mutation["decoys"]:
            problems.append(f"{row['instance_id']}: no decoy")
    return problems


def validate(rows: list[dict], workdir: str) -> list[str]:
    """Each task from the bundle: the hidden test fails at the base, passes with the gold patch."""
    clone = os.path.join(workdir, "clone")
    git("clone", "-q", os.path.join(workdir, "repo.bundle"), clone, cwd=workdir)
    problems = []
    for row in rows:
        git("checkout", "-q", "-f", row["base_commit"], cwd=clone)
        git("clean", "-fdqx", cwd=clone)
        for patch, want in ((row["test_patch"], 1), (row["patch"], 0)):
            subprocess.run(["git", "apply"], input=patch, text=True, cwd=clone, check=True)
            done = subprocess.run([sys.executable, "-m", "unittest", "-q",
                                   row["FAIL_TO_PASS"][0]], cwd=clone, capture_output=True)
            if (done.returncode != 0) != bool(want):
                problems.append(f"{row['instance_id']}: exit {done.returncode} "
                                f"{'at the base' if want else 'with the gold patch'}")
    return problems


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tasks", type=int, default=NUM_TASKS)
    parser.add_argument("--out", default=HERE, help="where tasks.jsonl and repo.bundle go")
    args = parser.parse_args()
    instances = first_instances(args.num_tasks, SEED)
    with tempfile.TemporaryDirectory() as workdir:
        rows = build(instances, workdir)
        problems = check_edits(rows) + validate(rows, workdir)
        if problems:
            sys.exit("\n".join(problems[:20]))
        shutil.copy(os.path.join(workdir, "repo.bundle"), os.path.join(args.out, "repo.bundle"))
    held = [r for r in rows if held_out(int(r["mutation"]["file"].split("/f")[1][:-3]))][:HELD_OUT]
    rows = [r for r in rows if r not in held] + held
    with open(os.path.join(args.out, "tasks.jsonl"), "w", encoding="ascii") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    kinds = {k: sum(r["mutation"]["kind"] == k for r in rows) for k in KINDS}
    print(f"{len(rows)} tasks ({HELD_OUT} held out at the end), kinds {kinds}")


if __name__ == "__main__":
    main()
