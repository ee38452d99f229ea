"""The two hub clients, at the libraries' own boundary: `huggingface_hub.HfApi` and `modelscope` `HubApi`.

Each takes the library object it calls (tests pass a recording fake, and bind every recorded call to the
installed library's real signature), so the only hub-specific code is which methods are called how.

Retries must never duplicate a commit: a Hugging Face push carries its push id in the commit description
and is skipped when the branch already has that commit; a ModelScope push is skipped when the repo already
holds every file with the same sha256. `classify` splits failures into transient (connection errors,
timeouts, 429, 5xx: retried) and permanent (401/403/404 and other 4xx: not).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

_PERMANENT = (401, 403, 404)
_TRANSIENT_NAMES = ("Connect", "Timeout", "Network", "RemoteProtocol", "ReadError", "WriteError")


class HubError(Exception):
    """A failed hub call; `transient` says whether trying again may succeed."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.status = status


@dataclass(frozen=True)
class PushRequest:
    repo_id: str
    folder: Path
    token: str
    private: bool
    revision: str | None
    commit_message: str
    marker: str
    """`carpool-push: <id>`, written into the commit so a retry can recognise it."""
    files: dict[str, str]
    """Relative path → sha256 of what `folder` holds."""


@dataclass(frozen=True)
class PushResult:
    revision: str | None
    """The commit id on the hub (None when the hub does not report one)."""
    url: str
    created: bool
    """False when a previous attempt had already committed these files."""


class HubClient(Protocol):
    def push(self, request: PushRequest) -> PushResult: ...


def status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def classify(exc: BaseException, what: str) -> HubError:
    """`exc` from a hub library as a `HubError` with a message that says what failed and whether it is final."""
    if isinstance(exc, HubError):
        return exc
    status = status_of(exc)
    detail = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    if status is not None:
        transient = status == 429 or status >= 500
        hint = {401: "the token is invalid", 403: "the token may not write to this repo",
                404: "the repo or revision does not exist"}.get(status, "")
        message = f"{what}: HTTP {status}" + (f" ({hint})" if hint else "") + f": {detail}"
        return HubError(message, transient=transient and status not in _PERMANENT, status=status)
    transient = isinstance(exc, ConnectionError | TimeoutError) or any(
        n in cls.__name__ for cls in type(exc).__mro__ for n in _TRANSIENT_NAMES)
    kind = "hub unreachable" if transient else "failed"
    return HubError(f"{what}: {kind} ({type(exc).__name__}: {detail})", transient=transient)


class HuggingFaceClient:
    """Pushes through an `HfApi` (or anything with its methods)."""

    def __init__(self, api: Any, endpoint: str = "https://huggingface.co") -> None:
        self._api = api
        self._endpoint = endpoint.rstrip("/")

    def push(self, request: PushRequest) -> PushResult:
        api, repo, token = self._api, request.repo_id, request.token
        _call("creating the repo", lambda: api.create_repo(repo, token=token, private=request.private,
                                                          repo_type="model", exist_ok=True))
        if request.revision:
            _call("creating the branch", lambda: api.create_branch(repo, branch=request.revision, token=token,
                                                                   repo_type="model", exist_ok=True))
        commits = _call("listing commits", lambda: api.list_repo_commits(repo, repo_type="model", token=token,
                                                                         revision=request.revision))
        for commit in commits:
            if request.marker in (getattr(commit, "message", "") or ""):
                log.info("push %s: already committed as %s", request.marker, commit.commit_id)
                return PushResult(commit.commit_id, self._commit_url(repo, commit.commit_id), created=False)
        info = _call("uploading", lambda: api.upload_folder(
            repo_id=repo, folder_path=str(request.folder), commit_message=request.commit_message,
            commit_description=request.marker, token=token, repo_type="model", revision=request.revision))
        revision = getattr(info, "oid", None)
        url = getattr(info, "commit_url", None) or self._commit_url(repo, revision)
        return PushResult(revision, str(url), created=True)

    def _commit_url(self, repo: str, revision: str | None) -> str:
        return f"{self._endpoint}/{repo}" + (f"/commit/{revision}" if revision else "")


class ModelScopeClient:
    """Pushes through a `modelscope.hub.api.HubApi` (or anything with its methods)."""

    def __init__(self, api: Any, endpoint: str = "https://modelscope.cn") -> None:
        self._api = api
        self._endpoint = endpoint.rstrip("/")

    def push(self, request: PushRequest) -> PushResult:
        api, repo, token = self._api, request.repo_id, request.token
        visibility = "private" if request.private else "public"
        _call("creating the repo", lambda: api.create_repo(repo, token=token, visibility=visibility,
                                                          repo_type="model", exist_ok=True))
        url = f"{self._endpoint}/models/{repo}"
        if self._already_there(repo, request):
            return PushResult(None, url, created=False)
        answer = _call("uploading", lambda: api.upload_folder(
            repo_id=repo, folder_path=str(request.folder), commit_message=request.commit_message,
            commit_description=request.marker, token=token, repo_type="model", revision=request.revision))
        revision = answer.get("commit_id") if isinstance(answer, dict) else None
        return PushResult(revision, url, created=True)

    def _already_there(self, repo: str, request: PushRequest) -> bool:
        try:
            files = self._api.get_model_files(repo, revision=request.revision, recursive=True)
        except Exception as exc:  # noqa: BLE001 - an empty new repo may 404 here: then nothing is there
            if classify(exc, "listing files").transient:
                raise classify(exc, "listing files") from exc
            return False
        remote = {f.get("Path"): f.get("Sha256") for f in files if isinstance(f, dict)}
        return all(remote.get(rel) == sha for rel, sha in request.files.items())


class UnavailableClient:
    """A hub this process cannot reach by design (its library is not installed): every push fails clearly."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def push(self, request: PushRequest) -> PushResult:
        raise HubError(self._reason, transient=False)


def _call(what: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:
        raise classify(exc, what) from exc
