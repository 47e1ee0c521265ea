"""Build hook: compiles the slab mover's native data path (``_slotio``) into the package.

kvhex works without it: where no C compiler or no Python headers are found, the build says so
and the file tier moves blocks in Python (docs/tiers.md). ``KVHEX_NATIVE=required`` makes a
failed compile, a compiler warning included, fail the build (the project's own environments and
CI set it), and ``KVHEX_NATIVE=off`` skips it (and removes an earlier build). ``CC`` names
the compiler.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "src/kvhex/adapters/storage/files/_slotio.c"


class NativeBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    """Compiles ``_slotio`` next to its source for wheels and editable installs."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        mode = os.environ.get("KVHEX_NATIVE", "auto")
        if self.target_name != "wheel":
            return
        source = os.path.join(self.root, SOURCE)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        target = source[: -len(".c")] + suffix
        if mode == "off":
            if os.path.exists(target):  # an earlier build: an editable install would load it
                os.unlink(target)
            return
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
            message = f"kvhex: the native data path was not built ({detail.strip()[:2000]})"
            if mode == "required":
                raise RuntimeError(message) from exc
            print(message + "; the file tier moves blocks in Python", file=sys.stderr)
            return
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        if version == "standard":  # an editable install imports it from the source tree
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["artifacts"].append(os.path.relpath(target, self.root))
