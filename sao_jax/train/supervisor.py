"""The run's children: engines (embedded, or SGLang servers started on this host) and workers,
started, watched, and restarted when they die (`Supervisor`), with the publisher keeping
restarted engines' weights current. What differs between kinds of engine is their entry in
`engines.ENGINES`."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

from sao_jax.models import CausalLM, save_hf
from sao_jax.rollout.stream import TrajectoryServer
from sao_jax.train.build import compilation_cache_dir
from sao_jax.train.engines import engine_of
from sao_jax.train.processes import ChildExited, Children, Command, worker_command
from sao_jax.train.publish import Publisher, weights_path, write_weights
from sao_jax.train.state import TrainState
from sao_jax.train.steps import Trainer
from sao_jax.train.tasks import Task


class BackgroundThread(threading.Thread):
    """A daemon thread whose `join()` re-raises the exception its target raised."""

    def __init__(self, target, name: str):
        super().__init__(name=name, daemon=True)
        self._target_fn, self._error = target, None
        self.start()

    def run(self):
        try:
            self._target_fn()
        except BaseException as e:  # noqa: BLE001 - handed to join()
            self._error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self._error is not None:
            raise self._error

    def wait(self) -> BaseException | None:
        """Waits for the thread; returns what its target raised instead of raising it."""
        super().join()
        return self._error


def worker_argv(config, task: Task, server: TrajectoryServer, urls: list[str],
                 vocab_size: int, routes: tuple[int, int] | None = None) -> list[str]:
    """A rollout worker's arguments; `routes`: `(layers, top_k)` of the experts its episodes
    ask the engines for (routing replay), or None."""
    argv = ["--learner", server.address, "--env", task.env,
            "--concurrency", str(config.rollout.worker_concurrency),
            "--temperature", str(config.rollout.temperature),
            "--max-turns", str(config.env.max_turns),
            "--max-action-tokens", str(config.env.max_action_tokens),
            "--max-response-tokens", str(config.env.max_response_tokens),
            "--max-context-tokens", str(config.rollout.engine_max_seq_len),
            "--vocab-size", str(vocab_size)]
    for url in urls:
        argv += ["--engine", url]
    if config.rollout.request_timeout_s:  # 0: the worker's own default
        argv += ["--request-timeout-s", str(config.rollout.request_timeout_s)]
    if task.tokenizer_path:
        argv += ["--tokenizer", task.tokenizer_path]
    if task.env_options:
        argv += ["--env-options", json.dumps(dict(task.env_options))]
    if routes is not None:
        argv += ["--routed-experts", ",".join(map(str, routes))]
    return argv


class Supervisor:
    """Starts the engines and workers of a run, and restarts those that die while it trains.

    - A worker that dies is started again with the same command line. The leases it held come
      back after `config.rollout.lease_timeout_s` (the stream issues them again), so no prompt is
      lost; until then they count against admission.
    - An embedded engine that dies is started again from the newest published weights
      (`Publisher.pinned`), which it loads before it listens, on the same port when that is free
      (the workers' URLs stay valid) or else on a new one (then the workers are restarted with the
      new URLs). A version published while it started is loaded as soon as it answers
      (`Publisher.resume`). Until then the publisher leaves it alone and the workers' clients fail
      over to the other engines. The restart runs on a thread: the learner keeps training.
    - SGLang servers started here (`rollout.engine = "sglang"` without `engine_urls`) are
      restarted as embedded engines are, under SGLang's interpreter (`sglang_server`): the
      engine's entry (`engines.EngineKind`) gives each kind's command, ports and timeout.
    - Servers of `rollout.engine_urls`, started by the user, are not restarted: the workers'
      clients retry them with backoff, and the publisher catches them up with the newest weights
      once they answer again (`Publisher.catch_up`).

    Each child is restarted at most `config.rollout.max_restarts` times per run; one more death
    makes `check` raise `ChildExited` naming its log, which stops the run.
    """

    def __init__(self, config, workdir: str, children: Children,
                 worker_argv: Callable[[list[str]], list[str]], log=print,
                 save: Callable[[CausalLM, str], None] = save_hf, **publishing):
        """`save` writes a policy as a Hugging Face directory (the first weights, and the
        publisher's); `publishing`: the other `Publisher` options."""
        self.config, self.workdir, self.children = config, workdir, children
        self.save, self.publishing = save, publishing
        self.worker_argv = worker_argv
        self.log = log
        self.publisher: Publisher | None = None
        self.kind = engine_of(config)
        self.engines: list[str] = []  # names of the engines started here, in the order of the URLs
        self._python: str | None = None  # what the engines run under (`EngineKind.prepare`)
        self._restarting: dict[str, BackgroundThread] = {}
        self._workers_moved = False  # an engine came back on a new port: restart the workers
        self._closed = False
        self._lock = threading.Lock()  # no respawn once closed

    def start(self, trainer: Trainer, state: TrainState) -> Publisher:
        """Starts the engines (or publishes to the configured ones) with `state`'s weights;
        returns the publisher that keeps them current, built with their URLs."""
        version, rollout = int(state.version), self.config.rollout
        model = trainer.policy_model(state)
        if self.kind.check_model is not None:
            self.kind.check_model(model.cfg.to_hf())
        if rollout.engine_urls:  # SGLang servers started by the user
            urls = [u.strip() for u in rollout.engine_urls.split(",") if u.strip()]
            self.publisher = self._publisher(urls)
            self.publisher.publish(model, version)
            return self.publisher
        self._python = self.kind.prepare(rollout, self.log)
        path = write_weights(model, weights_path(self.workdir, version), self.save)
        self.engines = [f"engine{i}" for i in range(rollout.num_engines)]
        ports = self.kind.ports(len(self.engines))
        urls = self.children.start_servers(
            self.engines, [self._engine_command(i, path, version, port)
                           for i, port in enumerate(ports)], self._startup_timeout_s())
        self.publisher = self._publisher(urls, started=version)
        return self.publisher

    def _publisher(self, urls: list[str], started: int | None = None) -> Publisher:
        return Publisher(self.workdir, urls, started=started, log=self.log, save=self.save,
                         update_timeout_s=self.config.rollout.weight_update_timeout_s,
                         **self.publishing)

    def _startup_timeout_s(self) -> float:
        return self.kind.startup_timeout_s(self.config.rollout)

    def _engine_command(self, i: int, path: str, version: int, port: int) -> Command:
        """Engine `i`'s command: serving the weights at `path` (`version`) on `port`, or on
        another port if `port` is 0 or taken (`Command.port` says which)."""
        return self.kind.command(self.config, i, path, version, port, python=self._python,
                                 cache_dir=compilation_cache_dir(self.config),
                                 calls_file=self.kernel_calls_file(f"engine{i}"))

    def kernel_calls_file(self, name: str) -> str:
        """Where an SGLang server on a CPU records calls of the stand-in kernels (none should
        happen: `sglang_server`)."""
        return os.path.join(self.children.log_dir, f"{name}.sgl_kernel_calls")

    def start_workers(self) -> None:
        for i in range(self.config.rollout.num_workers):
            self.children.start_worker(f"worker{i}", self.worker_argv(self.publisher.urls))

    def check(self) -> None:
        """Restarts the children that died (raises `ChildExited` for one out of restarts, and
        what an engine restart raised)."""
        for name, thread in list(self._restarting.items()):
            if not thread.is_alive():
                del self._restarting[name]
                thread.join()  # re-raises
        if self._workers_moved:
            self._workers_moved = False
            workers = [n for n, _ in self.children.procs if n.startswith("worker")]
            self.children.stop(workers)
            for name in workers:
                self.children.start_worker(name, self.worker_argv(self.publisher.urls))
            self.log(f"\nrestarted the workers with the engines {self.publisher.urls}; the "
                     f"leases they held come back after {self._lease_timeout_s():g} s")
        for name, code in self.children.exited():
            if name in self._restarting:
                continue
            if name in self.engines:
                self.publisher.suspend(self.publisher.urls[self.engines.index(name)])
                self._restarting[name] = BackgroundThread(
                    lambda n=name, c=code: self._restart_engine(n, c), name=f"restart-{name}")
                continue
            self.children.respawn(name, worker_command(self.worker_argv(self.publisher.urls)))
            self.log(f"\n{name} exited with code {code}: restarted it ({self._count(name)}); "
                     f"the leases it held come back after {self._lease_timeout_s():g} s; see "
                     f"{self.children.log_path(name)}")

    def _lease_timeout_s(self) -> float:
        return self.config.rollout.lease_timeout_s

    def _count(self, name: str) -> str:
        return f"restart {self.children.restarts[name]} of {self.children.max_restarts}"

    def _restart_engine(self, name: str, code: int) -> None:
        i = self.engines.index(name)
        url = self.publisher.urls[i]
        port = int(url.rsplit(":", 1)[1])
        while True:
            with self.publisher.pinned() as (path, version):
                with self._lock:
                    if self._closed:
                        return
                    command = self._engine_command(i, path, version, port)
                    new_port = command.port
                    proc = self.children.respawn(name, command)
                self.log(f"\n{name} exited with code {code}: restarting it ({self._count(name)}) "
                         f"on port {new_port} from weights v{version}, the ones served; "
                         "the other engines serve meanwhile")
                try:
                    new_url = self.children.wait_ready(name, proc, new_port,
                                                       self._startup_timeout_s())
                except ChildExited as e:
                    code = proc.returncode
                    self.log(f"\n{e}")
                    continue  # respawn raises once the restarts are used up
            held = self.publisher.resume(url, version, new_url)
            self.log(f"\n{name} is back on {new_url} with weights v{held}")
            if new_url != url:
                self._workers_moved = True
            return

    def finish(self) -> None:
        """Waits for engine restarts under way (raising what they raised), then restarts
        nothing more: the training loop is done."""
        for name, thread in list(self._restarting.items()):
            del self._restarting[name]
            thread.join()
        with self._lock:
            self._closed = True

    def close(self) -> None:
        """Restarts nothing more and publishes nothing more: the run is stopping."""
        with self._lock:
            self._closed = True
        if self.publisher is not None:
            self.publisher.close()
