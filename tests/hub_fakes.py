"""Recording fakes at the hub libraries' boundary (`huggingface_hub.HfApi`, `modelscope.hub.api.HubApi`).

The hubs are unreachable from test machines. These fakes keep an in-memory repo per id (commits with their
messages, files with their sha256), record every call as (method, args, kwargs), and can be told to fail
the next calls (`fail_next`). `bind_to_real_signatures` binds each recorded call to the installed library's
real method signature, so a library change breaks the build rather than production.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class FakeHTTPError(Exception):
    """Shaped like the libraries' HTTP errors: `.response.status_code`."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message or f"{status} error")
        self.response = type("Response", (), {"status_code": status})()


@dataclass
class Commit:
    commit_id: str
    title: str
    message: str


@dataclass
class Repo:
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=lambda: {"main": []})
    files: dict[str, bytes] = field(default_factory=dict)
    snapshot: Path | None = None
    """A copy of the last uploaded folder."""


class _Recording:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.repos: dict[str, Repo] = {}
        self._failures: list[tuple[str, BaseException]] = []
        self.after_upload: Callable[[], None] | None = None
        self._keep = Path(tempfile.mkdtemp(prefix="fake-hub-"))

    def fail_next(self, method: str, exc: BaseException, times: int = 1) -> None:
        self._failures.extend([(method, exc)] * times)

    def _record(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append((method, args, kwargs))
        for i, (name, exc) in enumerate(self._failures):
            if name in (method, "*"):
                del self._failures[i]
                raise exc

    def _commit(self, repo_id: str, revision: str | None, folder: str, title: str, description: str) -> Commit:
        repo = self.repos[repo_id]
        commits = repo.branches.setdefault(revision or "main", [])
        commit = Commit(hashlib.sha1(f"{repo_id}{len(commits)}{title}".encode()).hexdigest(), title,
                        f"{title}\n\n{description}")
        commits.insert(0, commit)  # newest first, as the hub lists them
        repo.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in Path(folder).rglob("*")
                      if p.is_file()}
        repo.snapshot = self._keep / repo_id / commit.commit_id
        shutil.copytree(folder, repo.snapshot)
        if self.after_upload is not None:
            hook, self.after_upload = self.after_upload, None
            hook()  # e.g. a crash after the commit landed
        return commit

    def commits(self, repo_id: str, revision: str | None = None) -> list[Commit]:
        return self.repos[repo_id].branches.get(revision or "main", [])


class FakeHfApi(_Recording):
    """The `HfApi` methods `HuggingFaceClient` calls."""

    def create_repo(self, repo_id: str, **kwargs: Any) -> str:
        self._record("create_repo", (repo_id,), kwargs)
        self.repos.setdefault(repo_id, Repo(private=bool(kwargs.get("private"))))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id: str, **kwargs: Any) -> None:
        self._record("create_branch", (repo_id,), kwargs)
        self.repos[repo_id].branches.setdefault(kwargs["branch"], [])

    def list_repo_commits(self, repo_id: str, **kwargs: Any) -> list[Commit]:
        self._record("list_repo_commits", (repo_id,), kwargs)
        return list(self.commits(repo_id, kwargs.get("revision")))

    def upload_folder(self, **kwargs: Any) -> Any:
        self._record("upload_folder", (), kwargs)
        commit = self._commit(kwargs["repo_id"], kwargs.get("revision"), str(kwargs["folder_path"]),
                              kwargs.get("commit_message") or "", kwargs.get("commit_description") or "")
        url = f"https://huggingface.co/{kwargs['repo_id']}/commit/{commit.commit_id}"
        return type("CommitInfo", (), {"oid": commit.commit_id, "commit_url": url})()


class FakeMsHubApi(_Recording):
    """The `modelscope.hub.api.HubApi` methods `ModelScopeClient` calls."""

    def create_repo(self, repo_id: str, **kwargs: Any) -> None:
        self._record("create_repo", (repo_id,), kwargs)
        self.repos.setdefault(repo_id, Repo(private=kwargs.get("visibility") == "private"))

    def get_model_files(self, model_id: str, **kwargs: Any) -> list[dict[str, Any]]:
        self._record("get_model_files", (model_id,), kwargs)
        files = self.repos[model_id].files
        return [{"Path": p, "Sha256": hashlib.sha256(b).hexdigest()} for p, b in sorted(files.items())]

    def upload_folder(self, repo_id: str, folder_path: Any = None, **kwargs: Any) -> dict[str, Any]:
        self._record("upload_folder", (repo_id,), {"folder_path": folder_path, **kwargs})
        commit = self._commit(repo_id, kwargs.get("revision"), str(folder_path), kwargs.get("commit_message") or "",
                              kwargs.get("commit_description") or "")
        return {"commit_id": commit.commit_id}


Delegate = Callable[[tuple[Any, ...], dict[str, Any]], None]


def bind_to_real_signatures(calls: list[Call], real: type, delegates: dict[str, Delegate] | None = None) -> int:
    """Bind every recorded call to `real`'s method; `delegates` also check what a `**kwargs` pass-through
    forwards (they get the call's args and kwargs). Raises `TypeError` on a call the library would refuse."""
    for method, args, kwargs in calls:
        inspect.signature(getattr(real, method)).bind(object(), *args, **kwargs)
        if delegates and method in delegates:
            delegates[method](args, kwargs)
    return len(calls)
