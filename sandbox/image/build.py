"""Build the sandbox image locally, without a registry, from this machine's own files.

Recipe (about 10 s the first time, a content-hash check afterwards):

1. Resolve the Debian packages of a minimal Python (``python3.11-minimal``,
   ``libpython3.11-stdlib``, ``dash``, ``coreutils``, ``libstdc++6``) and their installed
   dependencies with one ``dpkg-query`` call, and copy their files into a staging root.
2. Copy the extra Python packages (numpy and sympy by default, with their requirements) from
   the trainer's environment when the Python versions match, else ``pip install --target``.
3. Add ``/etc/passwd`` with an unprivileged ``sandbox`` user (uid 1000) and precompile
   ``.pyc`` files (the root file system is read-only at run time).
4. ``tar | docker import`` the staging root as ``tir-rl-sandbox:<hash>`` and tag it
   ``tir-rl-sandbox:latest``; keep the staging root as the bubblewrap backend's ``/``.

The image's content hash covers this file, the package versions and the options, so a
rebuild is skipped when nothing changed. Users with a registry can instead build
``sandbox/image/Dockerfile`` (any image with ``python3`` on its ``PATH`` works: the REPL server
is passed in on the command line when a sandbox starts).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tir_rl.errors import SandboxError, SetupError

logger = logging.getLogger(__name__)

RECIPE_VERSION = 1
IMAGE_PYTHON = "python3.11"
_SKIP_PREFIXES = (
    "/usr/share/doc", "/usr/share/man", "/usr/share/info", "/usr/share/locale",
    "/usr/share/lintian", "/usr/share/bug", "/usr/share/zsh", "/usr/share/bash-completion",
)
_MERGED_USR = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}


def default_cache_dir() -> Path:
    """Where staging roots live.

    ``$TIR_RL_SANDBOX_CACHE``, else ``/var/cache/tir-rl/sandbox`` for root (the bubblewrap
    backend drops to an unprivileged user that must read it), else ``~/.cache/tir-rl/sandbox``.
    """
    if os.environ.get("TIR_RL_SANDBOX_CACHE"):
        return Path(os.environ["TIR_RL_SANDBOX_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/cache/tir-rl/sandbox")
    return Path.home() / ".cache" / "tir-rl" / "sandbox"


@dataclass(kw_only=True)
class ImageBuilder:
    """Builds the sandbox image and root file system from the host's files."""

    @dataclass(kw_only=True)
    class Config:
        """Options of `tir-rl sandbox build`."""

        image: str = "tir-rl-sandbox"
        """Repository name of the image; tags are the content hash and ``latest``."""
        debian_packages: tuple[str, ...] = (
            "python3.11-minimal", "libpython3.11-stdlib", "dash", "coreutils", "libstdc++6",
        )
        """Debian packages (with their installed dependencies) copied into the root."""
        skip_debian_packages: tuple[str, ...] = ("dpkg", "debianutils", "perl-base", "tar")
        """Dependencies left out (package-management tools a sandbox never needs)."""
        python_packages: tuple[str, ...] = ("numpy", "sympy")
        """Extra Python distributions available inside the sandbox (with requirements)."""
        uid: int = 1000
        """User id of the unprivileged ``sandbox`` user."""
        cache_dir: Path = field(default_factory=default_cache_dir)
        """Where the staging root is kept (the bubblewrap backend runs on it)."""

    config: Config = field(default_factory=Config)

    # ------------------------------------------------------------------ public

    def build(self, *, force: bool = False) -> str:
        """Build the image unless an image with the same content hash exists; return its tag."""
        packages = self._debian_closure()
        dists = self._python_closure()
        digest = self._content_hash(packages, dists)
        tag = f"{self.config.image}:{digest}"
        rootfs = self.rootfs_for(digest)
        if not force and _image_exists(tag) and (rootfs / "usr/bin" / IMAGE_PYTHON).exists():
            _run(["docker", "tag", tag, f"{self.config.image}:latest"])
            self._point_current(rootfs)
            logger.info("sandbox image %s is up to date", tag)
            return tag
        logger.info("building sandbox image %s", tag)
        stage = rootfs.with_name(rootfs.name + ".partial")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        for folder in (stage, *stage.parents):  # the unprivileged bwrap user must reach it
            if folder == Path(folder.anchor) or (folder.stat().st_mode & 0o005) == 0o005:
                break
            if folder.is_relative_to(self.config.cache_dir.parent):
                folder.chmod(folder.stat().st_mode | 0o755)
        self._stage_debian(stage, packages)
        self._stage_python(stage, dists)
        self._stage_system(stage, digest)
        self._compile(stage)
        self._import(stage, tag, digest)
        shutil.rmtree(rootfs, ignore_errors=True)
        stage.rename(rootfs)
        self._point_current(rootfs)
        for old in self.config.cache_dir.glob("rootfs-*"):
            if old != rootfs and old.is_dir() and not old.name.endswith(".partial"):
                shutil.rmtree(old, ignore_errors=True)
        return tag

    def rootfs_for(self, digest: str) -> Path:
        """Staging root of the image with content hash `digest`."""
        return self.config.cache_dir / f"rootfs-{digest}"

    def current_rootfs(self) -> Path:
        """The root file system of the last build (a symlink to its staging root)."""
        return self.config.cache_dir / "rootfs"

    # ---------------------------------------------------------------- packages

    def _debian_closure(self) -> dict[str, str]:
        if shutil.which("dpkg-query") is None:
            raise SetupError(
                "The local image build copies Debian packages and needs dpkg-query. On other "
                "systems build sandbox/image/Dockerfile: "
                "`docker build -t tir-rl-sandbox:latest sandbox/image`."
            )
        out = _run(["dpkg-query", "-W", "-f=${Package}\t${Version}\t${Status}\t"
                    "${Depends}, ${Pre-Depends}\n"])
        installed: dict[str, tuple[str, str]] = {}
        for line in out.splitlines():
            name, version, status, deps = (line.split("\t") + ["", "", ""])[:4]
            if status.endswith(" installed"):
                installed[name] = (version, deps)
        closure: dict[str, str] = {}
        todo = list(self.config.debian_packages)
        while todo:
            name = todo.pop()
            if name in closure or name in self.config.skip_debian_packages:
                continue
            if name not in installed:
                raise SetupError(
                    f"Debian package {name!r} is needed for the sandbox image: "
                    f"`apt-get install -y {name}`"
                )
            version, deps = installed[name]
            closure[name] = version
            for group in deps.split(","):
                alternatives = [re.split(r"[\s:(]", a.strip())[0] for a in group.split("|")]
                alternatives = [a for a in alternatives if a]
                present = [a for a in alternatives if a in installed]
                if present:
                    todo.append(present[0])
        return dict(sorted(closure.items()))

    def _python_closure(self) -> dict[str, str]:
        """Distribution name -> version for the extra packages and their requirements."""
        result: dict[str, str] = {}
        todo = list(self.config.python_packages)
        while todo:
            name = _normalise(todo.pop())
            if name in result:
                continue
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                result[name] = "pip"
                continue
            result[name] = dist.version
            for req in dist.requires or []:
                if "extra ==" in req:
                    continue
                todo.append(re.split(r"[\s;<>=!~\[(]", req.strip())[0])
        return dict(sorted(result.items()))

    def _content_hash(self, packages: dict[str, str], dists: dict[str, str]) -> str:
        digest = hashlib.sha256()
        digest.update(Path(__file__).read_bytes())
        digest.update(json.dumps({
            "recipe": RECIPE_VERSION, "debian": packages, "python": dists,
            "uid": self.config.uid, "host_python": sys.version_info[:2],
        }, sort_keys=True).encode())
        return digest.hexdigest()[:16]

    # ----------------------------------------------------------------- staging

    def _stage_debian(self, stage: Path, packages: dict[str, str]) -> None:
        for name, target in _MERGED_USR.items():
            (stage / target).mkdir(parents=True, exist_ok=True)
            (stage / name).symlink_to(target)
        listing = _run(["dpkg-query", "-L", *packages])
        for line in listing.splitlines():
            path = line.strip()
            if not path.startswith("/") or path.startswith(_SKIP_PREFIXES):
                continue
            _copy_path(Path(path), stage)
            if path.endswith(".py"):  # Debian generates stdlib .pyc at install: take them too
                src = Path(path)
                cache = src.parent / "__pycache__"
                if cache.is_dir():
                    for pyc in cache.glob(src.stem + ".cpython-*.pyc"):
                        _copy_path(pyc, stage)

    def _stage_python(self, stage: Path, dists: dict[str, str]) -> None:
        target = stage / "usr/local/lib" / IMAGE_PYTHON / "dist-packages"
        target.mkdir(parents=True, exist_ok=True)
        same_python = f"python{sys.version_info[0]}.{sys.version_info[1]}" == IMAGE_PYTHON
        missing = []
        for name, version in dists.items():
            if version == "pip" or not same_python:
                missing.append(name if version == "pip" else f"{name}=={version}")
                continue
            dist = importlib.metadata.distribution(name)
            site = Path(str(dist.locate_file("")))
            tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
            for top in sorted(tops):
                src = site / top
                if src.is_dir():
                    shutil.copytree(src, target / top, symlinks=True, dirs_exist_ok=True)
                elif src.is_file():
                    shutil.copy2(src, target / top)
        if missing:
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
                   "--target", str(target), "--python-version", IMAGE_PYTHON[6:],
                   "--only-binary=:all:", *missing]
            logger.info("pip-installing %s into the image", " ".join(missing))
            _run(cmd)

    def _stage_system(self, stage: Path, digest: str) -> None:
        for folder in ("etc", "tmp", "proc", "dev", "sys", "home/sandbox", "work"):
            (stage / folder).mkdir(parents=True, exist_ok=True)
        os.chmod(stage / "tmp", 0o1777)
        uid = self.config.uid
        (stage / "etc/passwd").write_text(
            "root:x:0:0:root:/root:/bin/sh\n"
            f"sandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (stage / "etc/group").write_text(f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")
        (stage / "etc/hostname").write_text("sandbox\n")
        (stage / "etc/tir-rl-image").write_text(digest + "\n")
        sh = stage / "usr/bin/sh"
        if not sh.exists() and not sh.is_symlink():
            sh.symlink_to("dash")
        py = stage / "usr/bin/python3"
        if not py.exists() and not py.is_symlink():
            py.symlink_to(IMAGE_PYTHON)

    def _compile(self, stage: Path) -> None:
        """Precompile every module with the image's own interpreter (root is read-only)."""
        python = Path("/usr/bin") / IMAGE_PYTHON
        dirs = [stage / "usr/lib" / IMAGE_PYTHON, stage / "usr/local/lib" / IMAGE_PYTHON]
        dirs = [str(d) for d in dirs if d.is_dir()]
        # -s/-p make tracebacks show in-image paths; existing up-to-date .pyc are kept.
        subprocess.run(
            [str(python), "-m", "compileall", "-q", "-j", "0", "-s", str(stage), "-p", "/",
             *dirs], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def _import(self, stage: Path, tag: str, digest: str) -> None:
        changes = [
            f"USER {self.config.uid}:{self.config.uid}", "WORKDIR /tmp",
            "ENV PATH=/usr/local/bin:/usr/bin:/bin", "ENV HOME=/tmp", "ENV LANG=C.UTF-8",
            f"LABEL tir-rl.content-hash={digest}", 'CMD ["python3"]',
        ]
        cmd = ["docker", "import"]
        for change in changes:
            cmd += ["--change", change]
        tar = subprocess.Popen(["tar", "-C", str(stage), "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run([*cmd, "-", tag], stdin=tar.stdout, capture_output=True,
                                 text=True, check=False)
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise SandboxError(f"docker import failed: {imp.stderr.strip()} "
                               "(is the engine running? `bash scripts/docker-engine.sh`)")
        _run(["docker", "tag", tag, f"{self.config.image}:latest"])

    def _point_current(self, rootfs: Path) -> None:
        link = self.current_rootfs()
        tmp = link.with_name("rootfs.link-tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(rootfs.name)
        tmp.replace(link)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _copy_path(src: Path, stage: Path) -> None:
    """Copy file or symlink `src` to the same path under `stage` (directories are implicit)."""
    if src.is_dir() and not src.is_symlink():
        return
    dst = stage / str(src).lstrip("/")
    if dst.exists() or dst.is_symlink():
        return
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)
    except OSError as exc:  # a path diverted by dpkg-divert, or a dangling entry
        logger.debug("skipping %s: %s", src, exc)


def _image_exists(tag: str) -> bool:
    proc = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, check=False)
    if proc.returncode != 0 and b"Cannot connect" in proc.stderr:
        raise SetupError("The Docker engine is not running: `bash scripts/docker-engine.sh`")
    return proc.returncode == 0


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise SetupError(f"{cmd[0]} is not installed: `bash scripts/docker-engine.sh`") from exc
    if proc.returncode != 0:
        hint = " (`bash scripts/docker-engine.sh` starts the engine)" if cmd[0] == "docker" else ""
        raise SandboxError(f"`{' '.join(cmd[:3])} ...` failed: {proc.stderr.strip()}{hint}")
    return proc.stdout
