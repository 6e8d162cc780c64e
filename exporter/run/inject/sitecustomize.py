"""Loaded at start-up by every Python process that `gpumem-exporter run` starts: the launcher
puts this folder first on PYTHONPATH. It starts the gpumem agent (idle until the process uses
CUDA), then hands over to the sitecustomize that would have run without us, if any.

Nothing here may break the host program: every failure is reported in one line and ignored.
"""

import importlib
import os
import sys


def _start_agent() -> None:
    try:
        try:
            import exporter.run.agent as agent
        except ImportError:
            # The server's interpreter may not have gpumem-exporter installed: use the copy
            # the launcher runs from, at the lowest priority so it shadows nothing.
            path = os.environ.get("GPUMEM_EXPORTER_PATH")
            if not path:
                raise
            sys.path.append(path)
            import exporter.run.agent as agent
        agent.start_agent()
    except Exception as exc:
        print(f"gpumem-exporter: agent not started in pid {os.getpid()}: {exc}", file=sys.stderr)


def _chain() -> None:
    """Import the next sitecustomize on sys.path, as if this one did not exist."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    this = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    except Exception as exc:
        print(f"gpumem-exporter: the original sitecustomize failed: {exc}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if this is not None:
            sys.modules["sitecustomize"] = this


_start_agent()
_chain()
