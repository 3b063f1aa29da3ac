"""Models by Hub id: `zoo.hf.download` and every command's MODEL / SOURCE fetching a model
id missing from the local cache through `huggingface_hub`, against a local HTTP server on
127.0.0.1 that answers as the Hub's endpoints do (`/api/models/{id}/revision/{rev}`, and
`HEAD`/`GET /{id}/resolve/{rev}/{file}` with `X-Repo-Commit`, `ETag`, `Content-Length`;
`main` at `SHA`, the branch `v2` at `SHA2`, any other revision not found).
Nothing leaves the machine: `HF_ENDPOINT` points at the server, `HF_HOME` at a temporary
folder."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import re
import threading
import urllib.parse

import huggingface_hub  # noqa: F401  imported offline (tests/conftest.py): zoo's fetch follows the environment as it is then
import jax
import pytest
from helpers import one_line_error, save_word_tokenizer, tiny_decoder, zoo_main, zoo_ok

REPO = "tiny-org/tiny-llama"
SHA = "0123456789abcdef0123456789abcdef01234567"
SHA2 = "fedcba9876543210fedcba9876543210fedcba98"
COMMITS = {"main": SHA, SHA: SHA, "v2": SHA2, SHA2: SHA2}  # each repo's revisions (the same files at each)
BAD_TOKEN = "hf_stale"
WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "log"]


class Hub(http.server.ThreadingHTTPServer):
    """The Hub's model endpoints over `repos` (`{id: {file name: bytes}}`), each at the
    revisions `COMMITS` names; `requests` records `(method, path, Authorization header)`."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos, self.requests = repos, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Hub

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, body: bytes | None):
        path = urllib.parse.urlparse(self.path).path
        self.server.requests.append((self.command, path, self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if self.headers.get("Authorization") == f"Bearer {BAD_TOKEN}":  # as the Hub answers a stale token
            return self._send_error(401, None, "Invalid credentials in Authorization header")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:  # /api/models/org/name[/revision/rev]
            repo = "/".join(parts[2:4])
            if repo not in self.server.repos:
                return self._error(404, "RepoNotFound", f"Repository {repo} not found")
            revision = parts[5] if len(parts) >= 6 else "main"
            if revision not in COMMITS:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            info = {
                "id": repo,
                "sha": COMMITS[revision],
                "siblings": [{"rfilename": f} for f in sorted(self.server.repos[repo])],
            }
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) >= 5 and parts[2] == "resolve":  # /org/name/resolve/rev/file
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            files = self.server.repos.get(repo)
            if files is None:
                return self._error(404, "RepoNotFound", f"Repository {repo} not found")
            if name not in files:
                return self._error(404, "EntryNotFound", f"{name} does not exist")
            if parts[3] not in COMMITS:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
            data = files[name]
            headers = {
                "X-Repo-Commit": COMMITS[parts[3]],
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Content-Type": "application/octet-stream",
            }
            return self._send(200, data, headers, body)
        return self._error(404, "EntryNotFound", path)

    def _error(self, status: int, code: str, message: str):
        self._send_error(status, code, message)

    def _send_error(self, status: int, code: str | None, message: str):
        payload = json.dumps({"error": message}).encode()
        headers = {"X-Error-Message": message} | ({"X-Error-Code": code} if code else {})
        self._send(status, payload, headers, payload)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body is not None and self.command == "GET":
            self.wfile.write(data)

    def do_GET(self):
        self._answer(b"")

    def do_HEAD(self):
        self._answer(None)


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny Llama (zoo's export of `tiny_decoder`) with a word tokenizer, as the repo's
    files, plus files zoo does not fetch (a torch copy, a README)."""
    import zoo

    folder = tmp_path_factory.mktemp("llama")
    model = tiny_decoder(jax.random.key(0), vocab_size=len(WORDS), max_len=64)
    zoo.hf.save_pretrained(model, folder)
    save_word_tokenizer(WORDS, folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    return files | {"pytorch_model.bin": b"not fetched", "README.md": b"# tiny"}


@pytest.fixture
def hub(llama_files, tmp_path, monkeypatch):
    """The local Hub serving `REPO`, the environment pointed at it and at an empty cache."""
    server = Hub({REPO: llama_files, "tiny-org/torch-only": {"config.json": llama_files["config.json"],
                                                             "pytorch_model.bin": b"x"}})  # fmt: skip
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield server
    server.shutdown()
    server.server_close()


def test_download_fetches_the_config_weights_and_tokenizer_only(hub, llama_files, tmp_path, monkeypatch):
    import zoo

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    folder = zoo.hf.download(REPO)
    assert folder == tmp_path / "hf_home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / SHA
    fetched = sorted(p.name for p in folder.iterdir())
    assert fetched == sorted(n for n in llama_files if n not in ("pytorch_model.bin", "README.md")), fetched
    for name in fetched:
        assert (folder / name).read_bytes() == llama_files[name]
    model_requests = [r for r in hub.requests if "/api/models/" in r[1] or "/resolve/" in r[1]]
    assert all(auth == "Bearer hf_secret" for _, _, auth in model_requests), hub.requests
    assert ("GET", f"/api/models/{REPO}", "Bearer hf_secret") in hub.requests
    # The id alone now finds the snapshot in the cache, without asking the Hub again.
    hub.requests.clear()
    assert zoo.hf.resolve_model_dir(REPO) == folder
    assert not [r for r in hub.requests if "/api/models/" in r[1] or "/resolve/" in r[1]]
    model = zoo.hf.from_pretrained(REPO)
    assert model.config.vocab_size == len(WORDS)


def test_download_errors_name_what_was_tried(hub, tmp_path, monkeypatch):
    import zoo

    cache = tmp_path / "hf_home" / "hub"
    with pytest.raises(FileNotFoundError, match=rf"{cache}.*{hub.url}/api/models/tiny-org/absent.*has no such model"):
        zoo.hf.download("tiny-org/absent")
    with pytest.raises(FileNotFoundError, match=r"holds no safetensors weights \(it holds \['pytorch_model.bin'\]\)"):
        zoo.hf.download("tiny-org/torch-only")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    with pytest.raises(FileNotFoundError, match=rf"nor a model in the local Hugging Face cache \({cache}\).*OFFLINE"):
        zoo.hf.resolve_model_dir(REPO)
    assert not [r for r in hub.requests if "/api/models/" in r[1] or "/resolve/" in r[1]]


def test_a_token_the_hub_refuses_is_named_not_the_network(hub, monkeypatch):
    """A stale HF_TOKEN gets 401 "Invalid credentials" from the Hub, even for a public
    model: the error says the Hub refused the token, not that it could not be reached."""
    import zoo

    monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    with pytest.raises(
        FileNotFoundError, match=r"refused the token \(401: Invalid credentials.*set HF_TOKEN to a valid"
    ):
        zoo.hf.download(REPO)


def test_commands_take_a_hub_id_as_model(hub, tmp_path):
    """`zoo finetune ORG/NAME` fetches the model into the temporary cache and trains it;
    its adapter names the id and the commit (not this machine's cache path), so peft's
    AutoPeftModel opens it from a cache of that id with zoo's logits; `zoo info` and
    `zoo generate` take the id too (then from the cache)."""
    import numpy as np
    import peft
    import torch

    import zoo

    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": "the cat sat on the mat a dog ran"}) + "\n" for _ in range(16)))
    out = tmp_path / "run"
    tiny = ["--devices", "2", "--batch-size", "4", "--microbatches", "1", "--seq-len", "8", "--steps", "2", "--quiet"]
    zoo_ok("finetune", REPO, "--data", data, "--lora", "r=2,alpha=4", "--output", out, *tiny)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model"], saved["init"], saved["revision"]) == ("transformer", REPO, SHA)  # main's commit
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO, SHA)  # the commit it trained on
    tokens = np.array([[1, 2, 3, 4, 5]], np.int32)
    ours = np.asarray(zoo.train.load_run(out).model(tokens))
    opened = peft.AutoPeftModelForCausalLM.from_pretrained(
        out / "adapter", cache_dir=tmp_path / "hf_home" / "hub", local_files_only=True
    ).eval()
    with torch.no_grad():
        theirs = opened(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4
    assert any(path.endswith("model.safetensors") for _, path, _ in hub.requests)
    hub.requests.clear()
    info = json.loads(zoo_ok("info", REPO, "--devices", "2", "--json"))
    assert info["config"]["vocab_size"] == len(WORDS)
    out_text = zoo_ok("generate", REPO, "--prompt", "the cat", "--max-new-tokens", "3", "--json")
    assert json.loads(out_text)[0]["prompt"] == "the cat"
    assert not [r for r in hub.requests if "/resolve/" in r[1]]  # from the cache


def test_offline_mode_refuses_a_missing_model_in_one_line(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf_home" / "hub"
    for args in (["finetune", REPO], ["info", REPO], ["generate", REPO, "--prompt", "a"], ["train", "llama", "--init",
                 REPO]):  # fmt: skip
        rc, _, err = zoo_main(*args)
        one_line_error(rc, err, f"nor a model in the local Hugging Face cache ({cache}), and HF_HUB_OFFLINE is set")
    assert not [r for r in hub.requests if "/api/models/" in r[1] or "/resolve/" in r[1]]


def test_a_mistyped_folder_path_is_said_to_be_one_offline_and_online(hub, tmp_path, monkeypatch):
    """`zoo generate runs/typo` (a run folder that does not exist) reads like a model id;
    looked up as one and not found, the error also says `runs/` is a folder here without it."""
    import zoo

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    note = "(runs/ is a folder here but holds no typo: if you meant a local folder, check the path)"
    with pytest.raises(FileNotFoundError, match=r"has no such model .*" + re.escape(note)):
        zoo.hf.resolve_model_dir("runs/typo")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in (["generate", "runs/typo", "--prompt", "a"], ["finetune", "transformer", "--init", "runs/typo"]):
        rc, _, err = zoo_main(*args)
        one_line_error(rc, err, note)
    with pytest.raises(FileNotFoundError) as e:  # an id whose org is no folder here: no note
        zoo.hf.resolve_model_dir("absent-org/typo")
    assert "is a folder here" not in str(e.value)


def test_a_revision_is_fetched_and_the_run_records_its_commit(hub, llama_files, tmp_path):
    """`--revision` (a branch, tag or commit, as transformers' `revision=`): `zoo finetune
    ID --revision v2` fetches that branch and its config.json and adapter record its commit,
    which `zoo generate RUN` reads the base at (not main); `zoo generate ID --revision SHA`
    and `zoo.hf.from_pretrained(ID, revision=)` fetch that commit. A revision the Hub lacks,
    and one given with a local folder, are refused in one line."""
    import zoo
    from zoo._cli._generate import resolve_source

    cache = tmp_path / "hf_home" / "hub" / "models--tiny-org--tiny-llama" / "snapshots"
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": "the cat sat on the mat a dog ran"}) + "\n" for _ in range(16)))
    out = tmp_path / "run"
    tiny = ["--devices", "1", "--batch-size", "2", "--microbatches", "1", "--seq-len", "8", "--steps", "1", "--quiet"]
    zoo_ok("finetune", REPO, "--revision", "v2", "--data", data, "--lora", "r=2,alpha=4", "--output", out, *tiny)
    assert ("GET", f"/api/models/{REPO}/revision/v2", None) in hub.requests
    assert any(path == f"/{REPO}/resolve/{SHA2}/model.safetensors" for _, path, _ in hub.requests), hub.requests
    assert json.loads((out / "config.json").read_text())["revision"] == SHA2  # the commit, not the branch
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO, SHA2)
    assert resolve_source(str(out), None)[0] == cache / SHA2  # the run's base: its commit
    with pytest.raises(FileNotFoundError, match="nor a model in the local Hugging Face cache"):
        zoo.hf.resolve_model_dir(REPO, download=False)  # main is not cached: v2's snapshot is not main's
    hub.requests.clear()
    zoo_ok("generate", REPO, "--revision", SHA, "--prompt", "the cat", "--max-new-tokens", "2", "--json")
    assert any(path == f"/{REPO}/resolve/{SHA}/model.safetensors" for _, path, _ in hub.requests), hub.requests
    resume = zoo.train.RunConfig(output=str(out), resume=True)
    assert resume.resolved("finetune").revision == SHA2
    assert dataclasses.replace(resume, revision="v2").resolved("finetune").revision == SHA2  # the same commit
    with pytest.raises(zoo.train.ConfigError, match=rf"RunConfig.revision {SHA} \(was {SHA2}\) would change"):
        dataclasses.replace(resume, revision=SHA).resolved("finetune")
    info = json.loads(zoo_ok("info", REPO, "--revision", "v2", "--devices", "1", "--json"))
    assert info["init"] == str(cache / SHA2)  # built from that commit
    assert zoo.hf.from_pretrained(REPO, revision="v2").config.source_dir == str(cache / SHA2)
    for args in (["finetune", REPO, "--data", data, *tiny], ["generate", REPO, "--prompt", "a"]):
        rc, _, err = zoo_main(*args, "--revision", "nope")
        one_line_error(rc, err, f"{REPO!r}: the Hub ({hub.url}/api/models/{REPO}/revision/nope) has no revision 'nope'")
    local = cache / SHA2
    for args in (["generate", local, "--prompt", "a"], ["serve", local], ["inspect", "transformer", "--init", local],
                 ["finetune", "transformer", "--init", local, "--data", data]):  # fmt: skip
        rc, _, err = zoo_main(*args, "--revision", "v2")
        one_line_error(rc, err, "is a local folder, which has no revisions")
    rc, _, err = zoo_main("inspect", "mlp", "--revision", "v2")  # no Hub id to pin
    one_line_error(rc, err, "--revision 'v2' pins the Hub model --init names, and this run has no --init")
