"""Weights to the engines: each new policy version written as a Hugging Face directory and
loaded by every engine, in the background while the learner trains on (`Publisher`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Sequence

import aiohttp

from sao_jax.models import CausalLM, save_hf
from sao_jax.models.hf import COMPLETE_MARKER
from sao_jax.rollout.client import EngineUnavailableError, SGLangClient
from sao_jax.train.console import TrainingError
from sao_jax.train.state import TrainState
from sao_jax.train.steps import Trainer

KEEP_WEIGHT_VERSIONS = 2
WEIGHTS_DIR = "weights"  # <workdir>/weights/v<N>: the published versions


class Publisher:
    """Writes the policy as `<workdir>/weights/v<N>/` and loads it on every engine.

    `publish` does both before it returns (sync mode, the final weights). `submit` hands a copy of
    the parameters to a background thread and returns at once, so the learner's next step runs
    while the weights are written and the engines reload (async mode); when updates come faster
    than the engines take them, only the newest waiting one is published. `check` re-raises a
    failed background publish; `wait` blocks until every submitted version is handled.

    An engine that cannot be reached (connection refused or reset, or no answer within
    `update_timeout_s`: dead, restarting, frozen) does not fail a publish: it is left `behind`,
    with a warning, and the version counts as published (`version`) once written. Behind engines
    get the newest version with every later publish and, in async mode, from the background
    thread every `CATCH_UP_S` seconds (`catch_up`); an embedded engine that died is restarted
    with the newest version by the `Supervisor` (`suspend`, `pinned`, `resume`). An engine that
    answers but refuses the weights fails the publish (`TrainingError`): that is no outage.

    The engines' URLs are given at construction (`urls`), with `started`, the version they were
    started with, when the `Supervisor` started them (from `write_weights`); a restarted engine
    that comes back on another port is moved by `resume`.

    Injected staleness (`lag`, `rollout.lag_versions`): the engines serve the weights `lag`
    published versions behind the newest (`served`, while `version` is the newest written), so
    that rollouts are off-policy by a known amount; after a start or a resume the lag builds up
    over the first `lag` publishes. `newest()` gives the engines the newest weights for a block
    (an evaluation), then the lagged ones again.
    """

    CATCH_UP_S = 5.0

    def __init__(self, workdir: str, urls: list[str], *, started: int | None = None,
                 update_timeout_s: float = 600.0, log=print,
                 save: Callable[[CausalLM, str], None] = save_hf,
                 write_in_background: bool = True, lag: int = 0, drain_s: float = 0.0):
        """`urls`: the engines; `started`: the version they were started with (written under
        `workdir`), the newest and served; None: they hold nothing of this run yet."""
        if lag < 0:
            raise ValueError(f"rollout.lag_versions must be >= 0, got {lag}.")
        self.save, self.write_in_background, self.lag = save, write_in_background, lag
        self.workdir, self.root = workdir, os.path.join(workdir, WEIGHTS_DIR)
        os.makedirs(self.root, exist_ok=True)
        self.urls = list(urls)
        self.update_timeout_s = update_timeout_s
        self.drain_s = drain_s  # embedded engines: running requests' time to finish (client)
        self.log = log
        self.version: int | None = started  # the newest version written
        # the versions written, in order (the last lag + 1)
        self._written: list[int] = [] if started is None else [started]
        self._served: int | None = started  # what the engines hold (`version` without a lag)
        self.behind: set[str] = set()  # engines that missed `served`
        self._suspended: set[str] = set()  # engines being restarted: not sent anything
        self._pins: collections.Counter[int] = collections.Counter()  # versions kept on disk
        # One weight change at a time: publishes, catch-ups and a restarted engine's first sync.
        self.lock = threading.RLock()
        self._pending: tuple | None = None  # (the model to write, or None: written; version)
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._updating: tuple | None = None  # (loop, task) of the engine updates under way
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def path(self, version: int) -> str:
        return weights_path(self.workdir, version)

    @property
    def served(self) -> int | None:
        """The version the engines serve: `version`, or with a lag the one `lag` publishes
        before it."""
        return self.version if self._served is None else self._served

    def write(self, model: CausalLM, version: int) -> str:
        return write_weights(model, self.path(version), self.save)

    def publish(self, model: CausalLM, version: int) -> None:
        self.wait()
        self._publish(model, version)

    def _publish(self, model: CausalLM, version: int) -> None:
        with self.lock:
            self.write(model, version)
            self._load(version)

    def _load(self, version: int) -> None:
        """`version` is written: loads it on the engines, or with a lag the version `lag`
        publishes older (the lock held)."""
        with self.lock:
            written = self._written
            if not written or written[-1] != version:
                written = [*written, version][-(self.lag + 1):]
            if written[0] != self._served or not self.lag:
                self._serve(written[0])  # raises if an engine refuses: nothing changes here
            self._written, self.version = written, version
            keep = set(written) | {self._served}
            for name in os.listdir(self.root):  # the newest few, the served and pinned ones
                if name.startswith("v") and name[1:].isdigit():
                    v = int(name[1:])
                    if (v <= version - KEEP_WEIGHT_VERSIONS and v not in keep
                            and not self._pins[v]):
                        shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _serve(self, version: int) -> None:
        """Loads the written `version` on every engine not being restarted (the lock held)."""
        targets = [u for u in self.urls if u not in self._suspended]
        missed = self._update(targets, version)
        back = self.behind & set(targets) - missed
        self._served = version
        self.behind = missed | (set(self.urls) - set(targets))
        self._say_back(back)

    @contextlib.contextmanager
    def newest(self):
        """The engines serve the newest version while the block runs (an evaluation under
        injected staleness), then the lagged one again; nothing is published meanwhile."""
        with self.lock:
            lagged = self.served
            if lagged == self.version:
                yield
                return
            self._serve(self.version)
            try:
                yield
            finally:
                self._serve(lagged)

    def _update(self, urls: Sequence[str], version: int) -> set[str]:
        """Loads `weights/v<version>` on `urls`; returns those that could not be reached (and
        warns); raises `WeightUpdateError` if one refused the weights."""
        path = os.path.abspath(self.path(version))

        async def one(url):
            async with SGLangClient([url], max_retries=3) as client:
                try:
                    await asyncio.wait_for(client.update_weights_from_disk(
                        path, str(version), drain_s=self.drain_s),
                                           self.update_timeout_s)
                except Exception as e:
                    if not _unreachable(e):
                        raise
                    return url, f"{type(e).__name__}: {e}".strip(": ")
            return url, None

        async def each():
            with self._cond:
                if self._closed:
                    return [(url, "the run is stopping") for url in urls]
                self._updating = (asyncio.get_running_loop(), asyncio.current_task())
            try:
                return await asyncio.gather(*map(one, urls))
            except asyncio.CancelledError:  # close(): the engines are being stopped
                return [(url, "the run is stopping") for url in urls]
            finally:
                with self._cond:
                    self._updating = None
                    self._cond.notify_all()

        missed = {url: why for url, why in (asyncio.run(each()) if urls else []) if why}
        for url, why in missed.items():
            if url not in self.behind and not self._closed:
                self.log(f"\nwarning: weights v{version} not loaded on {url}, which cannot be "
                         f"reached ({why[:200]}); it gets the newest weights once it answers")
        return set(missed)

    def catch_up(self) -> None:
        """Sends the newest version to the engines left behind that answer again."""
        with self.lock:
            targets = sorted(self.behind - self._suspended)
            if self.served is None or not targets:
                return
            caught = set(targets) - self._update(targets, self.served)
            self.behind -= caught
            self._say_back(caught)

    def _say_back(self, urls) -> None:
        if not self._closed:
            for url in sorted(urls):
                self.log(f"\n{url} is back: it loaded weights v{self._served}")

    def suspend(self, url: str) -> None:
        """Sends `url` nothing until `resume` (its engine is being restarted)."""
        with self.lock:
            self._suspended.add(url)
            self.behind.add(url)

    @contextlib.contextmanager
    def pinned(self):
        """`(path, version)` of the served weights, kept on disk while the block runs."""
        with self.lock:
            version = self.served
            self._pins[version] += 1
        try:
            yield self.path(version), version
        finally:
            with self.lock:
                self._pins[version] -= 1

    def resume(self, url: str, version: int, new_url: str | None = None) -> int:
        """`url`'s engine is up again (at `new_url` if it moved) with `version` loaded: it gets
        the served version if that changed meanwhile. Returns the version it holds."""
        with self.lock:
            self._suspended.discard(url)
            self.behind.discard(url)
            if new_url is not None and new_url != url:
                self.urls = [new_url if u == url else u for u in self.urls]
                url = new_url
            if self.served != version and self._update([url], self.served):
                self.behind.add(url)
                return version
            return self.served

    def submit(self, trainer: Trainer, state: TrainState, version: int) -> None:
        """Publishes `state`'s policy as `version` in the background, unless that version is
        already out. Returns at once: the parameters are fetched there, once the step computing
        them is done. With `write_in_background` False (a multi-process learner, whose every
        process writes its share in step with the others) they are written here first, and
        only the engines' loading is left to the background."""
        self.check()
        if self.write_in_background:
            params = trainer.served_params(state.policy)  # the state is donated to the next step
            job = (lambda: trainer.policy_of(params), version)
        else:
            self.write(trainer.policy_model(state), version)
            job = (None, version)
        with self._cond:
            self._pending = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None:
                    if not self._cond.wait(self.CATCH_UP_S) and self.behind:
                        break
                job, self._pending = self._pending, None
                self._busy = True
            try:
                if job is None:
                    self.catch_up()
                    continue
                model, version = job
                if version != self.version:
                    if model is None:
                        self._load(version)
                    else:
                        self._publish(model(), version)
            except BaseException as e:  # noqa: BLE001 - re-raised by check()
                self._error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise TrainingError(f"publishing weights to the engines failed: {error}") from error

    def close(self, timeout_s: float = 2.0) -> None:
        """Drops what waits to be published and stays quiet about engines that go away (the
        run is stopping, its engines with it): engine updates under way are cancelled (waiting
        up to `timeout_s` for that), so that stopping the engines does not make them retry."""
        with self._cond:
            self._pending = None
            self._closed = True
            updating = self._updating
        if updating is not None:
            loop, task = updating
            with contextlib.suppress(RuntimeError):  # its loop has just ended
                loop.call_soon_threadsafe(task.cancel)
            with self._cond:
                self._cond.wait_for(lambda: self._updating is None, timeout_s)

    def wait(self) -> None:
        with self._cond:
            while self._pending is not None or self._busy:
                self._cond.wait()
        self.check()


def weights_path(workdir: str, version: int) -> str:
    """`<workdir>/weights/v<version>`: one published version, a Hugging Face directory."""
    return os.path.join(workdir, WEIGHTS_DIR, f"v{version}")


def write_weights(model: CausalLM, path: str,
                  save: Callable[[CausalLM, str], None] = save_hf) -> str:
    """Writes `model` to `path` whole or not at all (into `<path>.tmp`, then renamed), unless a
    complete copy is there already; returns `path`."""
    if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
        tmp = f"{path}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save(model, tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def _unreachable(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, says the engine could not be reached (no
    connection, or no answer in time), rather than that it refused."""
    while error is not None:
        if isinstance(error, EngineUnavailableError | aiohttp.ClientConnectionError
                      | TimeoutError):
            return True
        error = error.__cause__
    return False
