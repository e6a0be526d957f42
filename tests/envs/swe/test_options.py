"""`config.env.swe` as workers get it (`--env-options`) becomes the env's and grader's settings."""

import pytest

from experiments import base
from sao_jax.envs.swe import options
from sao_jax.envs.swe.env import PROMPT


def test_the_base_config_options_map_onto_env_workspace_and_grader():
    opts = base.get_config().env.swe.to_dict()
    config = options.env_config(opts, max_turns=7)
    assert config.max_turns == 7 and config.prompt_template == PROMPT  # "" = the env's own
    assert (config.command_timeout, config.output_chars) == (60.0, 10000)
    assert config.workspace.backend == "namespace"
    assert config.workspace.image_template == opts["image_template"]
    grader = options.grader(opts)
    assert grader is options.grader(dict(opts))  # one grader per worker and option set
    assert (grader.max_concurrent, grader.timeout) == (2, 1800.0)
    assert options.grader({**opts, "grade_concurrency": 3}).max_concurrent == 3


def test_the_base_config_declares_every_teacher_option():
    # ml_collections refuses an override of a field the config lacks: an option missing here
    # cannot be set from the command line (expert_read was, until it was added)
    assert set(options.TEACHER_FIELDS) <= set(base.get_config().env.swe)


def test_workspace_fields_pass_through_and_unknown_options_fail():
    config = options.env_config({"backend": "podman", "runtime_args": ["--cpus", "1"],
                                 "prompt_template": "fix {problem_statement}"}, max_turns=2)
    assert config.workspace.backend == "podman"
    assert config.workspace.runtime_args == ("--cpus", "1")
    assert config.prompt_template == "fix {problem_statement}"
    with pytest.raises(ValueError, match=r"unknown swe option\(s\) \['comand_timeout'\]"):
        options.env_config({"comand_timeout": 3}, max_turns=2)
    with pytest.raises(ValueError, match="WorkspaceConfig.backend must be one of"):
        options.env_config({"backend": "lxc"}, max_turns=2)
