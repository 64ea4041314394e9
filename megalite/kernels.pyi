# For the type checker only: `megalite.kernels` is the top-level kernels/ folder (setuptools' package-dir at
# install, megalite/__init__.py's finder in a source tree); mypy follows neither, so this names it.
from kernels._package import *  # noqa: F401,F403
from kernels import testing as testing  # noqa: F401
