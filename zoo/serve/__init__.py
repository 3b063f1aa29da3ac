"""Serving a decoder: continuous batching (`Engine`) and an OpenAI-compatible HTTP server.

- `Engine(model, slots=..., max_len=...)`: a fixed set of slots over one key/value cache;
  `submit(Request(...))` → `Handle`, `step()`, `stream(request)`, `start()` / `stop()`
  (a background thread). Usable without HTTP; tests and benchmarks drive it directly.
- `Request`, `Handle`, `Token`, `QueueFull`: what goes in and comes out.
- `Server` / `serve(...)`: the OpenAI API subset (`/v1/models`, `/v1/completions`,
  `/v1/chat/completions`, `/health`) over an `Engine`, on Starlette + uvicorn (the `serve`
  extra: `pip install 'eqx-zoo[serve]'`); `check_address(host, port)`: whether it can listen there.

docs/serving.md tells the whole story.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "._engine": ("Engine", "QueueFull"),
        "._requests": ("Handle", "Request", "Token"),
        "._http": ("Server", "check_address", "serve"),
    },
)

if TYPE_CHECKING:
    from ._engine import Engine, QueueFull
    from ._http import Server, check_address, serve
    from ._requests import Handle, Request, Token

__all__ = ["Engine", "Handle", "QueueFull", "Request", "Server", "Token", "check_address", "serve"]
