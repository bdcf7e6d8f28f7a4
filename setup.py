"""Package build: generates the protocol stubs before collecting modules."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProto(build_py):
    def run(self) -> None:
        generate = runpy.run_path(str(Path(__file__).parent / "proto" / "generate.py"))
        generate["generate"]()
        # The stub packages did not exist when setuptools listed packages.
        for pkg in ("ec_protocol._proto", "ec_protocol._proto.ec_daemon", "ec_protocol._proto.ec_daemon.v1"):
            if self.packages is not None and pkg not in self.packages:
                self.packages.append(pkg)
        super().run()


setup(cmdclass={"build_py": BuildWithProto})
