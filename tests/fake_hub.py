"""A local stand-in for the Hugging Face Hub HTTP API, for upload/download tests without network.

It implements the endpoints `huggingface_hub` (1.x and 2.x) calls for `create_repo`, `create_commit` /
`upload_folder` (preupload, git-LFS batch + basic PUT upload + verify, NDJSON commit), `create_branch`,
`repo_info`, tree / paths-info listings (used by `HfFileSystem` and `datasets.push_to_hub`) and file
downloads (`resolve`, used by `hf_hub_download`, `snapshot_download` and `from_pretrained`). Repositories live
in memory as a chain of commits (path -> bytes), so a test can assert exactly which files arrived.

Not implemented, on purpose: the Xet storage protocol (content-defined chunking to a CAS service, far beyond a
test fake). `huggingface_hub` uploads through Xet whenever `hf_xet` is installed, so clients must set
`HF_HUB_DISABLE_XET=1` (the `use_fake_hub` helper does), which makes them use the git-LFS path that the Hub
still accepts. Pull requests (`create_pr=True`) are refused.

Writes require a bearer token (any value), like the Hub.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import yaml

LFS_EXTENSIONS = (".safetensors", ".parquet", ".png", ".bin", ".arrow", ".pt")
LFS_MIN_SIZE = 64 * 1024


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    files: dict  # path -> (bytes, lfs sha256 or None)
    message: str
    parent: str | None


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    branches: dict = field(default_factory=dict)  # name -> commit sha
    commits: dict = field(default_factory=dict)  # sha -> Commit

    def resolve(self, revision: str) -> Commit | None:
        revision = unquote(revision)
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)


class FakeHub:
    """In-memory repositories + an HTTP server on 127.0.0.1 (random port)."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- test helpers -----------------------------------------------------------------------------------------

    def files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """path -> bytes of a repo at a revision (what a clone would contain)."""
        commit = self.repos[(repo_type, repo_id)].resolve(revision)
        return {path: data for path, (data, _) in commit.files.items()}

    def commits(self, repo_id: str, repo_type: str = "model", branch: str = "main") -> list[Commit]:
        repo = self.repos[(repo_type, repo_id)]
        out, sha = [], repo.branches.get(branch)
        while sha:
            out.append(repo.commits[sha])
            sha = repo.commits[sha].parent
        return out

    # -- operations -------------------------------------------------------------------------------------------

    def create_repo(self, repo_id: str, repo_type: str, private: bool) -> bool:
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                return False
            repo = Repo(repo_id, repo_type, private)
            initial = {".gitattributes": (b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", None)}
            sha = hashlib.sha1(f"init {repo_type} {repo_id}".encode()).hexdigest()
            repo.commits[sha] = Commit(sha, initial, "initial commit", None)
            repo.branches["main"] = sha
            self.repos[(repo_type, repo_id)] = repo
            return True

    def commit(self, repo: Repo, branch: str, lines: list[dict]) -> tuple[int, dict]:
        with self.lock:
            head = repo.branches.get(branch)
            if head is None:
                return 404, {"error": f"branch {branch} not found"}
            header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
            parent_commit = header.get("parentCommit")
            if parent_commit and parent_commit != head:
                return 412, {"error": "parent commit is not the branch head"}
            files = dict(repo.commits[head].files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                path = value.get("path")
                if key == "file":
                    files[path] = (base64.b64decode(value["content"]), None)
                elif key == "lfsFile":
                    data = self.lfs_objects.get(value["oid"])
                    if data is None or len(data) != value["size"]:
                        return 400, {"error": f"LFS object {value['oid']} for {path} was never uploaded"}
                    files[path] = (data, value["oid"])
                elif key == "deletedFile":
                    files.pop(path, None)
                elif key == "deletedFolder":
                    files = {p: v for p, v in files.items() if not p.startswith(path.rstrip("/") + "/")}
                else:
                    return 400, {"error": f"unsupported commit operation {key}"}
            digest = hashlib.sha1((head + json.dumps(sorted(files)) + str(time.time_ns())).encode())
            for path in sorted(files):
                digest.update(files[path][0])
            sha = digest.hexdigest()
            repo.commits[sha] = Commit(sha, files, header.get("summary", ""), head)
            repo.branches[branch] = sha
            return 200, {"commitOid": sha, "commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{sha}",
                         "pullRequestUrl": None}


# The pipeline tags the Hub accepts that a text model could carry (a subset of the Hub's list).
PIPELINE_TAGS = ("text-generation", "text2text-generation", "fill-mask", "feature-extraction", "other")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def card_metadata_errors(content: str) -> list[str]:
    """A subset of the Hub's README metadata checks (the ones a draft card can get wrong)."""
    if not content.startswith("---"):
        return []
    try:
        header = content.split("---", 2)[1]
        data = yaml.safe_load(header) or {}
    except (IndexError, yaml.YAMLError) as err:
        return [f"YAML metadata cannot be parsed: {err}"]
    errors = []
    if not isinstance(data, dict):
        return ["YAML metadata must be a mapping"]
    for key in ("license", "library_name", "pipeline_tag"):
        if key in data and not isinstance(data[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("tags", "datasets"):
        if key in data and not (isinstance(data[key], list) and all(isinstance(v, str) for v in data[key])):
            errors.append(f'"{key}" must be a list of strings')
    bases = data.get("base_model")
    for base in [bases] if isinstance(bases, str) else bases or []:
        if not isinstance(base, str) or not _HUB_ID.match(base):
            errors.append(f'"base_model" with value "{base}" is not valid. Use a model id from https://hf.co/models.')
    if data.get("pipeline_tag") is not None and data["pipeline_tag"] not in PIPELINE_TAGS:
        errors.append(f'"pipeline_tag" {data["pipeline_tag"]!r} is not a known pipeline tag')
    return errors


def _entries(commit: Commit, prefix: str, recursive: bool) -> list[dict]:
    """Tree entries (files and folders) under `prefix` of a commit, like /api/.../tree."""
    prefix = prefix.strip("/")
    base = prefix + "/" if prefix else ""
    out, folders = [], set()
    for path, (data, lfs) in sorted(commit.files.items()):
        if not path.startswith(base):
            continue
        rest = path[len(base):]
        parts = rest.split("/")
        for i in range(1, len(parts)):
            folder = base + "/".join(parts[:i])
            if (recursive or i == 1) and folder not in folders:
                folders.add(folder)
                out.append({"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()})
        if recursive or len(parts) == 1:
            out.append(_file_entry(path, data, lfs))
    return out


def _file_entry(path: str, data: bytes, lfs: str | None) -> dict:
    entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)}
    if lfs:
        entry["lfs"] = {"oid": lfs, "size": len(data), "pointerSize": 134}
    return entry


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        # -- plumbing ---------------------------------------------------------------------------------------

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length) if length else b""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                data = self._read_chunked()
            if self.headers.get("Content-Encoding") == "gzip":
                data = gzip.decompress(data)
            return data

        def _read_chunked(self) -> bytes:
            out = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()

        def _send(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None):
            if body is None:
                body = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            content_type = "application/json" if payload is not None else "application/octet-stream"
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str | None, message: str):
            headers = {"X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, {"error": message}, headers)

        def _authorized(self) -> bool:
            if not self.headers.get("Authorization", "").startswith("Bearer "):
                self._error(401, None, "write access needs a token")
                return False
            return True

        def _repo(self, repo_type: str, repo_id: str) -> Repo | None:
            repo = hub.repos.get((repo_type, repo_id))
            if repo is None:
                self._error(404, "RepoNotFound", f"repository {repo_type}/{repo_id} not found")
            return repo

        def _commit(self, repo: Repo, revision: str) -> Commit | None:
            commit = repo.resolve(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"revision {revision} not found")
            return commit

        # -- routing ----------------------------------------------------------------------------------------

        def do_HEAD(self):
            self._route()

        def do_GET(self):
            self._route()

        def do_POST(self):
            self._route()

        def do_PUT(self):
            self._route()

        def _route(self):
            url = urlparse(self.path)
            parts = [unquote(p) for p in url.path.split("/") if p]
            query = parse_qs(url.query)
            hub.requests.append((self.command, url.path))
            try:
                if parts[:3] == ["api", "repos", "create"]:
                    return self._create_repo()
                if parts[:2] == ["api", "validate-yaml"]:
                    return self._validate_yaml()
                if parts and parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets", "spaces"):
                    return self._api(parts[1][:-1], "/".join(parts[2:4]), parts[4:], query)
                if parts and parts[0] == "_lfs":
                    return self._lfs_object(parts[1], parts[2])
                repo_type = "model"
                if parts and parts[0] in ("datasets", "spaces"):
                    repo_type, parts = parts[0][:-1], parts[1:]
                if len(parts) >= 2 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
                    return self._lfs_batch()
                if len(parts) >= 4 and parts[2] == "resolve":
                    return self._resolve(repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
                self._error(404, None, f"no fake endpoint for {self.command} {url.path}")
            except Exception as err:  # surface server bugs as 500s with the message
                self._error(500, None, f"fake hub error: {type(err).__name__}: {err}")

        # -- endpoints --------------------------------------------------------------------------------------

        def _create_repo(self):
            if not self._authorized():
                return
            payload = json.loads(self._body() or b"{}")
            name, org = payload["name"], payload.get("organization")
            repo_id = f"{org or 'user'}/{name}" if "/" not in name else name
            repo_type = payload.get("type") or "model"
            private = bool(payload.get("private")) or payload.get("visibility") == "private"
            prefix = "" if repo_type == "model" else f"{repo_type}s/"
            url = f"{hub.endpoint}/{prefix}{repo_id}"
            if not hub.create_repo(repo_id, repo_type, private):
                return self._send(409, {"error": "You already created this repo", "url": url},
                                  {"X-Error-Message": "You already created this repo"})
            self._send(200, {"url": url, "name": repo_id, "id": repo_id})

        def _validate_yaml(self):
            content = json.loads(self._body())["content"]
            errors = card_metadata_errors(content)
            if errors:
                return self._send(400, {"errors": [{"message": e} for e in errors], "warnings": []},
                                  {"X-Error-Message": "; ".join(errors)})
            self._send(200, {"errors": [], "warnings": []})

        def _api(self, repo_type: str, repo_id: str, rest: list[str], query: dict):
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return
            op = rest[0] if rest else "revision"
            if op == "revision":
                commit = self._commit(repo, rest[1] if len(rest) > 1 else "main")
                if commit:
                    siblings = [{"rfilename": p, "size": len(d)} for p, (d, _) in sorted(commit.files.items())]
                    self._send(200, {"id": repo_id, "_id": repo_id, "sha": commit.sha, "private": repo.private,
                                     "siblings": siblings, "tags": [], "lastModified": "2026-01-01T00:00:00.000Z",
                                     "author": repo_id.split("/")[0], "disabled": False, "gated": False})
            elif op == "preupload":
                if not self._authorized():
                    return
                if query.get("create_pr"):
                    return self._error(400, None, "the fake hub does not implement pull requests")
                files = json.loads(self._body())["files"]
                modes = []
                for f in files:
                    lfs = f["path"].endswith(LFS_EXTENSIONS) or f["size"] >= LFS_MIN_SIZE
                    modes.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
                self._send(200, {"files": modes, "commitOid": repo.branches.get("main")})
            elif op == "commit":
                if not self._authorized():
                    return
                if query.get("create_pr"):
                    return self._error(400, None, "the fake hub does not implement pull requests")
                lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
                status, payload = hub.commit(repo, unquote(rest[1]), lines)
                self._send(status, payload, {"X-Error-Message": payload.get("error", "")} if status != 200 else None)
            elif op == "branch":
                if not self._authorized():
                    return
                branch = unquote("/".join(rest[1:]))
                with hub.lock:
                    if branch in repo.branches:
                        return self._error(409, None, f"branch {branch} already exists")
                    body = json.loads(self._body() or b"{}")
                    start = repo.resolve(body.get("startingPoint") or "main")
                    repo.branches[branch] = start.sha
                self._send(200, {})
            elif op == "tree":
                commit = self._commit(repo, rest[1])
                if commit is None:
                    return
                path = "/".join(rest[2:])
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                entries = _entries(commit, path, recursive)
                if path and not entries and path not in commit.files:
                    return self._error(404, "EntryNotFound", f"{path} does not exist at {rest[1]}")
                self._send(200, entries)
            elif op == "paths-info":
                commit = self._commit(repo, rest[1])
                if commit is None:
                    return
                body = self._body()
                if self.headers.get("Content-Type", "").startswith("application/json"):
                    paths = json.loads(body).get("paths", [])
                else:
                    paths = parse_qs(body.decode()).get("paths", [])
                out = []
                for path in paths:
                    path = path.strip("/")
                    if path in commit.files:
                        data, lfs = commit.files[path]
                        out.append(_file_entry(path, data, lfs))
                    elif any(p.startswith(path + "/") for p in commit.files):
                        out.append({"type": "directory", "path": path, "oid": hashlib.sha1(path.encode()).hexdigest()})
                self._send(200, out)
            else:
                self._error(404, None, f"no fake endpoint /api/{repo_type}s/{repo_id}/{'/'.join(rest)}")

        def _lfs_batch(self):
            if not self._authorized():
                return
            payload = json.loads(self._body())
            objects = []
            for obj in payload["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs_objects:
                    entry["actions"] = {
                        "upload": {"href": f"{hub.endpoint}/_lfs/upload/{obj['oid']}"},
                        "verify": {"href": f"{hub.endpoint}/_lfs/verify/{obj['oid']}"},
                    }
                objects.append(entry)
            self._send(200, {"transfer": "basic", "objects": objects})

        def _lfs_object(self, action: str, oid: str):
            data = self._body()
            if action == "upload":
                if hashlib.sha256(data).hexdigest() != oid:
                    return self._error(400, None, "uploaded bytes do not match the announced sha256")
                hub.lfs_objects[oid] = data
                return self._send(200, {})
            if oid not in hub.lfs_objects:
                return self._error(404, None, f"LFS object {oid} missing")
            self._send(200, {})

        def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str):
            repo = self._repo(repo_type, repo_id)
            if repo is None:
                return
            commit = self._commit(repo, revision)
            if commit is None:
                return
            if path not in commit.files:
                return self._error(404, "EntryNotFound", f"{path} does not exist at {revision}")
            data, lfs = commit.files[path]
            headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{git_blob_oid(data)}"'}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{lfs}"', "X-Linked-Size": str(len(data))})
            self._send(200, headers=headers, body=data)

    return Handler


def use_fake_hub(monkeypatch, hub: FakeHub, cache_dir) -> None:
    """Point huggingface_hub, transformers and datasets at `hub` for the rest of a test.

    The same as exporting HF_ENDPOINT, HF_HUB_DISABLE_XET=1, HF_TOKEN and HF_HUB_CACHE before the libraries
    are imported (what a subprocess test does); in-process the modules already read those variables, so their
    constants are patched too.
    """
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    template = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    try:
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.endpoint)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    except ImportError:
        pass


def subprocess_env(hub: FakeHub, cache_dir) -> dict:
    """Environment variables that point a fresh process at `hub`."""
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": "hf_fake_token",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_CACHE": str(cache_dir),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


try:
    import pytest

    @pytest.fixture
    def fake_hub(monkeypatch, tmp_path):
        """A running FakeHub that huggingface_hub/transformers/datasets in this process talk to."""
        hub = FakeHub().start()
        use_fake_hub(monkeypatch, hub, tmp_path / "hf-cache")
        yield hub
        hub.stop()

except ImportError:  # pragma: no cover - the module is also usable without pytest
    pass
