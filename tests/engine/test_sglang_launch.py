"""`sao_jax.engine.sglang_server` without SGLang: which models SGLang would serve wrongly, each
server's command line and environment, and the config checks that name the field to fix. (The
servers themselves: tests/engine/test_sglang_server.py, marker `sglang`.)"""

import os

import pytest

from experiments import toy_sglang
from sao_jax.engine import sglang_server
from sao_jax.models.config import preset
from sao_jax.train.build import check_config


def test_models_sglangs_qwen3_moe_would_serve_wrongly_are_refused_by_field():
    with pytest.raises(ValueError, match="tie_word_embeddings = True, mlp_only_layers = \\[0\\]"
                       ".*'toy_moe'"):
        sglang_server.check_servable(preset("toy").to_hf())
    with pytest.raises(ValueError, match="decoder_sparse_step = 2"):
        sglang_server.check_servable(preset("toy_moe", decoder_sparse_step=2).to_hf())
    for fine in (preset("toy_moe"), preset("qwen3-30b-a3b"), preset("small"),
                 preset("toy", num_experts=0)):  # a dense Qwen3 may tie its head
        sglang_server.check_servable(fine.to_hf())


def test_the_server_command_and_environment():
    argv = sglang_server.server_argv("/w/v3", port=30001, weight_version=3, device="cpu",
                                     max_running_requests=16, context_length=128,
                                     extra_args="--chunked-prefill-size 64")
    assert argv[0] == sglang_server.CHILD_SCRIPT
    flag = lambda name: argv[argv.index(name) + 1]
    assert flag("--host") == "127.0.0.1" and flag("--port") == "30001"
    assert flag("--weight-version") == "3" and flag("--max-total-tokens") == str(16 * 128)
    assert "--skip-tokenizer-init" in argv and "--sleep-on-idle" in argv
    assert argv[-2:] == ["--chunked-prefill-size", "64"]
    assert "--device" not in sglang_server.server_argv("/w", port=1, weight_version=0,
                                                       device="cuda")

    env = sglang_server.server_env("cpu", "/logs/calls", base={"PYTHONPATH": "/project",
                                                               "VIRTUAL_ENV": "/project/.venv"})
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"] == sglang_server.STAND_IN_DIR  # not the project's
    assert "VIRTUAL_ENV" not in env and env["SAO_SGL_KERNEL_CALLS"] == "/logs/calls"
    assert os.path.isfile(os.path.join(env["PYTHONPATH"], "sgl_kernel", "__init__.py"))
    gpu = sglang_server.server_env("cuda", base={})
    assert "PYTHONPATH" not in gpu and "SGLANG_USE_CPU_ENGINE" not in gpu
    with pytest.raises(ValueError, match="rollout.sglang.device"):
        sglang_server.server_env("tpu")


def test_config_checks_name_the_field():
    config = toy_sglang.get_config()
    check_config(config)  # toy_moe: servable
    config.model.preset = "toy"
    with pytest.raises(ValueError, match="'toy_moe'"):
        check_config(config)
    config = toy_sglang.get_config()
    config.rollout.engine, config.rollout.engine_urls = "embedded", "http://127.0.0.1:30000"
    with pytest.raises(ValueError, match="engine_urls"):
        check_config(config)
    config = toy_sglang.get_config()
    config.rollout.sglang.device = "tpu"
    with pytest.raises(ValueError, match="rollout.sglang.device"):
        check_config(config)


def test_an_unready_virtualenv_is_reported(tmp_path):
    assert not sglang_server.is_ready(str(tmp_path / "none"))
    assert sglang_server.main(["--check", "--venv", str(tmp_path / "none")]) == 1


def test_the_virtualenv_is_made_with_pip_in_the_plain_environment(tmp_path, monkeypatch):
    """pip runs in this process's environment; only the import check runs as a CPU server
    starts, with the stand-in kernels on its path; the marker comes last."""
    calls = []
    venv = str(tmp_path / "venv")

    def call(argv, env=None, **_):
        calls.append((argv, env))
        if argv[1:3] == ["-m", "venv"]:  # what `python -m venv` leaves: an interpreter
            os.makedirs(os.path.dirname(sglang_server.python(venv)))
            with open(sglang_server.python(venv), "w") as f:
                f.write("#!/bin/sh\n")
            os.chmod(sglang_server.python(venv), 0o755)
        return 0

    monkeypatch.setattr(sglang_server.subprocess, "call", call)
    assert sglang_server.ensure_venv(venv, log=lambda *_: None) == sglang_server.python(venv)
    assert [env for _, env in calls[:3]] == [None, None, None]
    assert "pip" in calls[2][0] and calls[3][0][-1].startswith("import sglang")
    assert calls[3][1]["SGLANG_USE_CPU_ENGINE"] == "1"
    assert sglang_server.is_ready(venv)
