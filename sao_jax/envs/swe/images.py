"""Container images built here from Debian packages, for hosts that cannot pull from a registry.

    tag = build_debian_image()   # localhost/sao-jax/swe-base:bookworm, built once, then reused

`debootstrap --variant=minbase` writes a Debian root filesystem from the host's apt mirror (about
40 s for bookworm with python3 and git), which `podman import` (or `docker import`) turns into an
image; the image is kept by the runtime, so later calls return at once. Needs root and the
`debootstrap` package (`apt-get install debootstrap`).

    python -m sao_jax.envs.swe.images [--runtime podman] [--tag TAG]   # prints the tag
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from sao_jax.envs.swe.workspace import WorkspaceError

BASE_TAG = "localhost/sao-jax/swe-base:bookworm"
BASE_PACKAGES = ("python3", "python-is-python3", "git", "patch")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def image_exists(runtime: str, tag: str) -> bool:
    """Whether `runtime` (podman | docker) holds the image `tag` locally."""
    argv = ([runtime, "image", "exists", tag] if os.path.basename(runtime) == "podman"
            else [runtime, "image", "inspect", tag])
    return subprocess.run(argv, capture_output=True).returncode == 0


def build_debian_image(runtime: str = "podman", tag: str = BASE_TAG,
                       packages: tuple[str, ...] = BASE_PACKAGES, mirror: str | None = None,
                       suite: str = "bookworm") -> str:
    """Returns `tag`, after building it when `runtime` does not hold it yet.

    Args:
      runtime: podman or docker (a name on PATH or a path).
      tag: the image's name; an existing image of that name is reused as it is, whatever its
        packages (remove it to rebuild: `podman rmi TAG`).
      packages: Debian packages installed on top of minbase.
      mirror: the Debian mirror; None reads the host's apt sources (else deb.debian.org).
      suite: the Debian release.

    Raises:
      WorkspaceError: the runtime or debootstrap is missing, or a step failed (its output
        included).
    """
    binary = shutil.which(runtime)
    if binary is None:
        raise WorkspaceError(f"{runtime} not found on PATH: install it (`apt-get install "
                             f"{'podman' if 'podman' in runtime else 'docker.io'}`).")
    # One build at a time on this host: a second caller waits, then finds the image.
    with open(os.path.join(tempfile.gettempdir(), "sao-jax-image-build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if image_exists(binary, tag):
            return tag
        debootstrap = shutil.which("debootstrap")
        if debootstrap is None:
            raise WorkspaceError(f"image {tag} is not here and debootstrap, which builds it, is "
                                 "missing: `apt-get install debootstrap` (needs root).")
        mirror = mirror or host_debian_mirror()
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="sao-jax-rootfs-", dir="/var/tmp") as tmp:
            rootfs = os.path.join(tmp, "rootfs")
            _progress(f"debootstrap {suite} ({', '.join(packages)}) from {mirror} into {rootfs}")
            _check([debootstrap, "--variant=minbase", f"--include={','.join(packages)}", suite,
                    rootfs, mirror], "debootstrap")
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in os.scandir(os.path.join(rootfs, cache)):
                    if entry.is_file():
                        os.unlink(entry.path)
            _progress(f"importing {rootfs} as {tag}")
            tar = subprocess.Popen(["tar", "-C", rootfs, "--numeric-owner", "-c", "."],
                                   stdout=subprocess.PIPE)
            imported = subprocess.run([binary, "import", "--change", 'CMD ["/bin/bash"]', "-",
                                       tag], stdin=tar.stdout, capture_output=True, text=True)
            tar.stdout.close()
            if tar.wait() != 0 or imported.returncode != 0:
                raise WorkspaceError(f"`{runtime} import` of {rootfs} as {tag} failed: "
                                     f"{imported.stderr.strip()[-2000:]}")
        _progress(f"built {tag} in {time.monotonic() - start:.0f} s")
        return tag


def host_debian_mirror() -> str:
    """The host's Debian mirror from its apt sources (deb822 or one-line), else deb.debian.org."""
    deb822 = "/etc/apt/sources.list.d/debian.sources"
    if os.path.isfile(deb822):
        with open(deb822) as f:
            for line in f:
                uris = re.match(r"URIs:\s*(\S+)", line)
                if uris and "security" not in uris.group(1):
                    return uris.group(1)
    if os.path.isfile("/etc/apt/sources.list"):
        with open("/etc/apt/sources.list") as f:
            for line in f:
                deb = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", line)
                if deb and "security" not in deb.group(1):
                    return deb.group(1)
    return DEFAULT_MIRROR


def _check(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise WorkspaceError(f"{what} failed (exit {done.returncode}): "
                             f"{done.stdout.strip()[-2000:]}")


def _progress(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runtime", default="podman")
    parser.add_argument("--tag", default=BASE_TAG)
    parser.add_argument("--mirror", default=None)
    args = parser.parse_args(argv)
    print(build_debian_image(args.runtime, args.tag, mirror=args.mirror))


if __name__ == "__main__":
    main()
