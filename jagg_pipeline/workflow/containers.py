"""What a job needs to run this package inside the workflow's images (``--sdm apptainer``).

The images (containers/*.def) hold the locked dependencies, not the package: a job runs the
package from the checkout the workflow runs from, bound into the container and put first on
its PYTHONPATH, so the images change only with the lock and a code change needs no rebuild.
Pure functions of the package's location and the environment (torch-free).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import jagg_pipeline

APPTAINER_BIND = "APPTAINER_BIND"
# Apptainer sets the variable X inside the container from APPTAINERENV_X on the host.
CONTAINER_PYTHONPATH = "APPTAINERENV_PYTHONPATH"


def package_root() -> Path:
    """The folder that holds the ``jagg_pipeline`` package (an editable install's checkout)."""
    return Path(jagg_pipeline.__file__).resolve().parent.parent


def apptainer_environ(root: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make ``apptainer exec`` bind ``root`` and import the package from it.

    ``root`` goes ahead of the PYTHONPATH that ``environ`` (the job's environment) already
    has; binds it already lists stay.
    """
    binds = [bind for bind in environ.get(APPTAINER_BIND, "").split(",") if bind]
    if not any(bind.split(":")[0] == str(root) for bind in binds):
        binds.append(str(root))
    paths = [str(root), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        APPTAINER_BIND: ",".join(binds),
        CONTAINER_PYTHONPATH: os.pathsep.join(dict.fromkeys(paths)),
    }
