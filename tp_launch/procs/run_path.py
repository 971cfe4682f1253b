"""``--run-path``: run the training script with ``runpy.run_path`` as ``__main__``.

torchrun runs it in a multiprocessing child of the agent; tp-run runs it in a fresh
interpreter (``python -u -m tp_launch.procs.run_path SCRIPT ARGS...``), which gives
the script the same ``sys.argv`` and ``__name__``.
"""

import runpy
import sys

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
