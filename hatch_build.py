"""Build hook: compiles kvhex's native modules into the package.

* ``_slotio``: the slab mover's data path (without it the file tier moves blocks in Python,
  docs/tiers.md);
* ``_hostslots``: the host tier's per-key bookkeeping under the built-in LRU policy (without
  it that bookkeeping runs in Python, docs/performance.md).

kvhex works without them: where no C compiler or no Python headers are found, the build says
so and the Python paths run. ``KVHEX_NATIVE=required`` makes a failed compile, a compiler
warning included, fail the build (the project's own environments and CI set it), and
``KVHEX_NATIVE=off`` skips them (and removes earlier builds). ``CC`` names the compiler.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCES = {
    "src/kvhex/adapters/storage/files/_slotio.c": "the file tier moves blocks in Python",
    "src/kvhex/domain/_hostslots.c": "the host tier's LRU bookkeeping runs in Python",
}
"""Each native module's source, and what runs where it was not built."""


class NativeBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compiles ``_slotio`` next to its source for wheels and editable installs."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        built = [self._build(source, fallback) for source, fallback in SOURCES.items()]
        if version == "standard" and any(built):  # (an editable install imports the tree's)
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            for target in filter(None, built):
                build_data["artifacts"].append(os.path.relpath(target, self.root))

    def _build(self, relative: str, fallback: str) -> str | None:
        """Compile ``relative``; the built module's path, or None (not built: why printed)."""
        mode = os.environ.get("KVHEX_NATIVE", "auto")
        source = os.path.join(self.root, relative)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        target = source[: -len(".c")] + suffix
        if mode == "off":
            if os.path.exists(target):  # an earlier build: an editable install would load it
                os.unlink(target)
            return None
        # written aside, then moved in place: a running process may have the target loaded
        partial = f"{source[: -len('.c')]}.{os.getpid()}.partial{suffix}"
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        command = [
            *cc,
            "-O2",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wall",
            *(["-Werror"] if mode == "required" else []),  # a newer compiler's new warning
            # must not cost a user the native path; the project's own builds allow none
            f"-I{sysconfig.get_paths()['include']}",
            source,
            "-o",
            partial,
        ]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(partial, target)
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.path.exists(target):  # an earlier build of other source: never imported
                os.unlink(target)
            detail = getattr(exc, "stderr", "") or str(exc)
            name = os.path.basename(relative)[: -len(".c")]
            message = f"kvhex: the native module {name} was not built ({detail.strip()[:2000]})"
            if mode == "required":
                raise RuntimeError(message) from exc
            print(f"{message}; {fallback}", file=sys.stderr)
            return None
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return target
