"""`nkicache exec`'s bootstrap: this folder is put first on the command's PYTHONPATH, so every Python process the
command starts imports this module at start-up (site's `sitecustomize` hook). It installs a post-import hook for
the loop classes named in NKICACHE_EXEC_LOOPS (MODULE:CLASS,...): when one of those modules is imported, the tier
is attached to its class (workers.attach). Until then nothing else is imported, so a command that creates no
loop pays almost nothing. The user's own sitecustomize, if any, still runs, after this one.
"""

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


class _PostImportFinder:
    """A meta path finder that finds nothing itself: for a watched module, it lets the other finders find it and
    runs the hook once the module is executed."""

    def __init__(self, watched):
        self.watched = watched  # module name -> class name

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.watched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _HookedLoader(spec.loader, self.watched[fullname])
                return spec
            if spec is not None:
                return spec
        return None


class _HookedLoader:
    def __init__(self, loader, class_name):
        self.loader, self.class_name = loader, class_name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        from workers.attach import attach_from_environment

        attach_from_environment(module, self.class_name)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _install():
    watched = {}
    for item in filter(None, os.environ.get("NKICACHE_EXEC_LOOPS", "").split(",")):
        module, _, class_name = item.partition(":")
        watched[module] = class_name
    if watched:
        sys.meta_path.insert(0, _PostImportFinder(watched))


def _run_users_sitecustomize():
    """The sitecustomize this one shadows (a virtualenv's, a distribution's), run as it would be without us."""
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_install()
_run_users_sitecustomize()
