"""Models by Hub id (`org/name`): found in the local Hugging Face cache
(`resolve_model_dir`), else fetched from the Hub into it, through `huggingface_hub`: only what zoo reads (the config, the
safetensors weights, the tokenizer's files), with its progress bars.

The environment is read when a model is fetched, not when a module is imported:
`HF_ENDPOINT` (the Hub's address), `HF_TOKEN` (private and gated models), the cache
(`hub_cache`: `HF_HUB_CACHE`, else `$HF_HOME/hub`) and `HF_HUB_OFFLINE` (nothing is
fetched; a model missing from the cache is refused in one line naming the cache).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from pathlib import Path

from ._files import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, hub_cache

# What zoo reads of a model's repository: its config, its weights (one file or shards and
# their index), the tokenizer and its chat template. Nothing else is fetched (no
# pytorch_model.bin, no ONNX or GGUF copies, no README or images).
FILES = (
    CONFIG_NAME,
    "generation_config.json",
    WEIGHTS_NAME,
    INDEX_NAME,
    "model-*-of-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_ENDPOINT = "https://huggingface.co"


def _true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or transformers' `TRANSFORMERS_OFFLINE`) forbids the Hub."""
    return _true("HF_HUB_OFFLINE") or _true("TRANSFORMERS_OFFLINE")


def endpoint() -> str:
    """The Hub's address: `HF_ENDPOINT`, else https://huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def wanted(names: list[str]) -> list[str]:
    """The files of a repository listing (`names`) that zoo reads (`FILES`), in order."""
    return [n for n in names if any(fnmatch.fnmatchcase(n, pattern) for pattern in FILES)]


def download_model(repo_id: str, *, revision: str | None = None) -> Path:
    """Fetch model `repo_id` (`org/name`) at `revision` (default `main`) from the Hub into
    the local Hugging Face cache and return its snapshot folder: the folder
    `zoo.hf.from_pretrained` reads, laid out as transformers' own download leaves it (a
    later `from_pretrained` of the id, zoo's or transformers', finds it there).

    Only `FILES` are fetched (the config, the safetensors weights, the tokenizer), each
    with a progress bar on stderr. `HF_ENDPOINT`, `HF_TOKEN` and the cache folder
    (`HF_HUB_CACHE`, else `$HF_HOME/hub`) are read now.

    **Arguments:**

    - `repo_id`: the model's id on the Hub.
    - `revision`: a branch, tag or commit (default `main`).

    **Returns:** the snapshot folder. Raises `FileNotFoundError` in one line naming what
    was tried (the address and the cache): in offline mode (`HF_HUB_OFFLINE=1`), for a
    model the Hub does not have (or not to this token), a token it refuses (401/403),
    one without safetensors weights, or when the Hub cannot be reached. Needs the package `huggingface_hub`.
    """
    cache = hub_cache()
    if offline():
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a model in the local Hugging Face cache ({cache}), and "
            "HF_HUB_OFFLINE is set: unset it to fetch the model from the Hub, or pass the folder that holds it"
        )
    try:
        import huggingface_hub as hub
        from huggingface_hub import errors
    except ImportError as e:  # a dependency of zoo and of tokenizers: only a broken install lacks it
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({cache}) and huggingface_hub, which fetches it, is "
            "not installed: pip install huggingface_hub"
        ) from e
    from huggingface_hub import constants

    with _online(constants):
        return _fetch(hub, errors, repo_id, revision, cache)


@contextlib.contextmanager
def _online(constants):
    """huggingface_hub reads HF_HUB_OFFLINE once, when it is imported; zoo reads it when a
    model is fetched (`offline()` said no): its value now holds while fetching."""
    before = getattr(constants, "HF_HUB_OFFLINE", False)
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _fetch(hub, errors, repo_id: str, revision: str | None, cache: Path) -> Path:
    """`download_model`'s requests (online)."""
    where = endpoint()
    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's stored login, if any
    tried = f"{where}/api/models/{repo_id}" + (f"/revision/{revision}" if revision else "")
    try:
        info = hub.HfApi(endpoint=where, token=token).model_info(repo_id, revision=revision)
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as e:
        gated = isinstance(e, errors.GatedRepoError)
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a model in the local Hugging Face cache ({cache}), and the "
            f"Hub ({tried}) "
            + (
                "holds it gated: accept its terms on its page, then set HF_TOKEN"
                if gated
                else "has no such model (or not for this token: set HF_TOKEN for a private one)"
            )
        ) from None
    except errors.RevisionNotFoundError:
        raise FileNotFoundError(
            f"{repo_id!r}: the Hub ({tried}) has no revision {revision!r}: pass a branch, tag or commit of the "
            "model (the default is main)"
        ) from None
    except Exception as e:  # the network's errors (httpx's, OSError), the Hub's (HfHubHTTPError)
        answer = _refusal(e, tried)
        if answer:
            raise FileNotFoundError(
                f"{repo_id!r} is not in the local Hugging Face cache ({cache}) and {answer}"
            ) from None
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor in the local Hugging Face cache ({cache}) and the Hub could not be reached "
            f"({tried}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the network or "
            "HF_ENDPOINT, or set HF_HUB_OFFLINE=1 and pass a local folder"
        ) from None
    names = [s.rfilename for s in info.siblings or []]
    files = wanted(names)
    if CONFIG_NAME not in files or not any(f.endswith(".safetensors") for f in files):
        others = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx"))]
        raise FileNotFoundError(
            f"{repo_id!r} on the Hub ({tried}) holds no "
            + (CONFIG_NAME if CONFIG_NAME not in files else "safetensors weights")
            + (f" (it holds {others[:3]})" if others else "")
            + ": zoo reads config.json + model.safetensors (transformers converts: "
            "AutoModel.from_pretrained(id).save_pretrained(folder), then pass the folder)"
        )
    folder = None
    for name in files:
        try:
            path = hub.hf_hub_download(
                repo_id, name, revision=info.sha, cache_dir=str(cache), endpoint=where, token=token
            )
        except Exception as e:  # as above: the download stops; what it completed stays in the cache
            raise FileNotFoundError(
                f"{repo_id!r}: fetching {name} from {where}/{repo_id}/resolve/{info.sha}/{name} failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run again to continue"
            ) from None
        folder = Path(path).parent if "/" not in name else Path(path).parents[name.count("/")]
    # `hf_hub_download` of a commit stores no ref: record the branch the id names, so that
    # the id alone finds this snapshot next time (as transformers' own download does).
    ref = Path(cache) / ("models--" + repo_id.replace("/", "--")) / "refs" / (revision or "main")
    if info.sha and (revision or "main") != info.sha and not ref.is_file():
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(info.sha)
    assert folder is not None
    return folder


def _refusal(error: Exception, tried: str) -> str | None:
    """What the Hub answered, for an HTTP error it sent (it was reached): a refused token
    (401: stale or mistyped; 403: no access to this model) names the token to fix."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if not isinstance(status, int):
        return None
    said = getattr(error, "server_message", None) or str(error).splitlines()[0]
    if status == 401:
        return (
            f"the Hub ({tried}) refused the token (401: {said}): set HF_TOKEN to a valid token, or unset it (and "
            "`hf auth logout`) for a public model"
        )
    if status == 403:
        return f"the Hub ({tried}) refused access (403: {said}): use a token (HF_TOKEN) with read access to this model"
    return f"the Hub ({tried}) answered {status} ({said}): try again later, or pass a local folder"


def resolve_model_dir(path_or_id: str | os.PathLike, *, download: bool = True, revision: str | None = None) -> Path:
    """The model folder `path_or_id` names: a local folder, or a model id (`org/name`) in
    the local Hugging Face hub cache (`models--org--name/snapshots/<commit>/`: the commit
    `refs/main` points at, else the only snapshot no other ref names), fetched from the Hub first when it is
    not there (`zoo.hf.download`: the config, safetensors and tokenizer files only; not
    with `download=False` or `HF_HUB_OFFLINE=1`).

    `revision`: a branch, tag or commit of the model id (default `main`): the cache's
    snapshot of that commit, or the one `refs/REVISION` points at, else fetched. The
    folder's name is the commit (`hub_id_of`). A local folder has no revisions: a
    `revision` with one is refused (`ValueError`), where transformers would ignore it.

    **Returns:** the folder. Raises `FileNotFoundError` in one line saying what was tried.
    """
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError(
                f"revision {revision!r} names a commit of a Hub model, and {str(path_or_id)!r} is a local folder, "
                "which has none: drop the revision, or pass the model's id (org/name)"
            )
        return path
    text = str(path_or_id)
    if not looks_like_id(text):
        raise FileNotFoundError(
            f"no model directory at {text!r}: pass the folder that holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME} (what `save_pretrained` writes), or a Hugging Face model id (org/name)"
        )
    cache = hub_cache()
    repo = cache / ("models--" + text.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / (revision or "main")
    candidates = []
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        candidates = [snapshots / ref.read_text().strip()]
    elif revision and (snapshots / revision).is_dir():  # a commit
        candidates = [snapshots / revision]
    elif not revision and snapshots.is_dir():  # no main: a snapshot no other branch or tag names
        named = {f.read_text().strip() for f in (repo / "refs").rglob("*") if f.is_file()}
        candidates = sorted(p for p in snapshots.iterdir() if p.is_dir() and p.name not in named)
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        raise FileNotFoundError(
            f"{text!r} has {len(candidates)} snapshots in {snapshots} and no refs/main to choose one; "
            f"pass the snapshot folder itself (one of {[p.name for p in candidates]}), or a revision"
        )
    try:
        if download:
            return download_model(text, revision=revision)
        at = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"{text!r}{at} is neither a local folder nor a model in the local Hugging Face cache ({repo} does not "
            "hold it; the cache is HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub): pass its "
            "folder, or its id to fetch it from the Hub"
        )
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}{_mistyped_folder(text)}") from None


def _mistyped_folder(text: str) -> str:
    """A note for an `org/name` that failed as a model id while `org` is a folder here:
    most likely a mistyped path (`runs/sft` for a run that does not exist)."""
    org, _, name = text.partition("/")
    if name and Path(org).is_dir():
        return f" ({org}/ is a folder here but holds no {name}: if you meant a local folder, check the path)"
    return ""


def looks_like_id(text: str) -> bool:
    """Whether `text` may be a Hugging Face model id: `name` or `org/name`, no path syntax."""
    return 0 < len(text) and text.count("/") <= 1 and not text.startswith((".", "/", "~")) and text.strip("/ ") == text


def hub_id_of(folder: str | os.PathLike | None) -> tuple[str, str] | None:
    """The Hub id and revision of a snapshot folder of a Hugging Face cache
    (`.../models--org--name/snapshots/<rev>`: `("org/name", "<rev>")`), else `None`.

    An adapter of a model loaded by Hub id names that id and the commit it trained on
    (`base_model_name_or_path`, `revision`), as peft writes one of a model transformers
    fetched: the cache's path holds on this machine only. Hub names hold no `--`, so the
    folder's name reads back one way."""
    if folder is None:
        return None
    parts = Path(folder).parts
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    return parts[-3].removeprefix("models--").replace("--", "/"), parts[-1]


download = download_model  # zoo.hf.download
