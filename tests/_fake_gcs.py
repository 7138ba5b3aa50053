"""A fake `gs://` for tests: every `gs://bucket/key` lives at `<root>/bucket/key` on local disk.

    with fake_gcs(tmp_path / "gcs"):
        epath.Path("gs://bucket/run").mkdir(parents=True)   # -> <root>/bucket/run

Both ways a checkpoint reaches GCS are redirected: `etils.epath` (which Orbax, grain and our code
use for directories, metadata and small files) gets a backend that maps the URL onto the root
and, like GCS, needs no directory above a key to write it; Orbax's TensorStore spec for a
`gs://` path (its `gcs` kvstore) becomes a `file` kvstore at the same place, and its bucket query
(hierarchical namespace, a google-cloud-storage call) answers "no". Everything else runs the
real `gs://` code path: a library call that turns the URL into a local path
(`Path(url).absolute()`, `open(url)`, `shutil`, `np.memmap`) writes under `<cwd>/gs:/...`
instead, and the test sees it there.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

from etils.epath import backend as backend_lib
from etils.epath import gpath
from orbax.checkpoint._src.path import gcs_utils

PREFIX = "gs://"


class _LocalBucketBackend(backend_lib._OsPathBackend):
    """epath's local-disk backend with `gs://bucket/key` read as `<root>/bucket/key`."""

    def __init__(self, root):
        self.root = os.fspath(root)

    def _local(self, path) -> str:
        path = os.fspath(path)
        return os.path.join(self.root, path[len(PREFIX) :]) if path.startswith(PREFIX) else path

    def _url(self, path) -> str:
        path = os.fspath(path)
        if path == self.root or path.startswith(self.root + os.sep):
            return PREFIX + os.path.relpath(path, self.root)
        return path

    def _parent(self, path) -> str:
        """Creates the local directory above `path`: an object store needs none to write."""
        local = self._local(path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        return local

    def open(self, path, mode):
        return super().open(self._parent(path) if "r" not in mode else self._local(path), mode)

    def exists(self, path):
        return super().exists(self._local(path))

    def isdir(self, path):
        return super().isdir(self._local(path))

    def listdir(self, path):
        return super().listdir(self._local(path))

    def glob(self, path):
        return [self._url(p) for p in super().glob(self._local(path))]

    def walk(self, top, *, top_down=True, on_error=None):
        for root, dirs, files in super().walk(
            self._local(top), top_down=top_down, on_error=on_error
        ):
            yield self._url(root), dirs, files

    def makedirs(self, path, *, exist_ok=False, mode=None):
        return super().makedirs(self._local(path), exist_ok=exist_ok, mode=mode)

    def mkdir(self, path, *, exist_ok=False, mode=None):
        return super().mkdir(self._local(path), exist_ok=exist_ok, mode=mode)

    def rmtree(self, path):
        return super().rmtree(self._local(path))

    def remove(self, path):
        return super().remove(self._local(path))

    def rename(self, path, dst):
        return super().rename(self._local(path), self._parent(dst))

    def replace(self, path, dst):
        return super().replace(self._local(path), self._parent(dst))

    def copy(self, path, dst, overwrite):
        return super().copy(self._local(path), self._parent(dst), overwrite)

    def stat(self, path):
        return super().stat(self._local(path))


@contextlib.contextmanager
def fake_gcs(root):
    """Serves `gs://` from the local directory `root` while the context is open."""
    os.makedirs(root, exist_ok=True)
    backend = _LocalBucketBackend(root)

    def kvstore(path):
        bucket, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
        return {"driver": "file", "path": os.path.join(os.fspath(root), bucket, key)}

    with (
        mock.patch.dict(gpath._PREFIX_TO_BACKEND, {"gs": backend}),
        # A copy or rename between a local path and gs:// goes through the gs:// backend.
        mock.patch.object(gpath, "_GCS_BACKENDS", gpath._GCS_BACKENDS | {backend}),
        mock.patch.object(gcs_utils, "get_kvstore_for_gcs", kvstore),
        mock.patch.object(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False),
    ):
        yield
